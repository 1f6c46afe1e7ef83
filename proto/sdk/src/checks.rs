//! What every agent running checks needs (PROTOCOL.md, "Checks"): the rules of a
//! `RunChecks` request ([`check_request`], [X2]), the timeout a file runs under
//! ([`check_timeout`]), and a file's answer from how it ran ([`result`], [X3]). [`Agent`]
//! applies the rules, one run per live lesson at a time ([X4]) and the READY check before a
//! backend's [`Backend::run_checks`] runs the files.
//!
//! [`Agent`]: super::Agent
//! [`Backend::run_checks`]: super::Backend::run_checks

use std::collections::HashSet;
use std::time::Duration;

use antidote_proto::agent::v1::{CheckFile, CheckResult, ConfigurationType, LessonSpec};
use antidote_proto::limits::{MAX_CHECK_OUTPUT, MAX_CONFIGURATION_FILE, MAX_CONFIGURATION_STAGE};
use tonic::Status;

use super::output::Tail;
use super::{errors, spec};

/// Checks a request's files against the protocol's rules ([X2]): at least one, one per
/// endpoint at most, each for an endpoint of `held` (the newest spec of the live lesson, when
/// it is held), of a type the agent runs (`offered`: its capabilities), a file name as a
/// configuration's, within the size caps.
pub fn check_request(
    files: &[CheckFile],
    held: Option<&LessonSpec>,
    offered: &[String],
) -> Result<(), Status> {
    if files.is_empty() {
        return Err(errors::invalid("files", "at least one file"));
    }
    let mut endpoints = HashSet::new();
    let mut total = 0;
    for (i, file) in files.iter().enumerate() {
        let field = |name: &str| format!("files[{i}].{name}");
        if !endpoints.insert(file.endpoint.as_str()) {
            return Err(errors::invalid(
                field("endpoint"),
                format!(
                    "endpoint `{}` has another file in this request",
                    file.endpoint
                ),
            ));
        }
        if let Some(held) = held
            && !held.endpoints.iter().any(|e| e.name == file.endpoint)
        {
            return Err(errors::invalid(
                field("endpoint"),
                format!("`{}` is not an endpoint of the live lesson", file.endpoint),
            ));
        }
        match ConfigurationType::try_from(file.r#type) {
            Ok(ConfigurationType::Shell) => {}
            Ok(ConfigurationType::Python) if spec::runs(offered, ConfigurationType::Python) => {}
            Ok(ConfigurationType::Python) => {
                return Err(errors::invalid(
                    field("type"),
                    "python files run only on an agent offering configuration.python",
                ));
            }
            _ => {
                return Err(errors::invalid(
                    field("type"),
                    "CONFIGURATION_TYPE_SHELL or CONFIGURATION_TYPE_PYTHON",
                ));
            }
        }
        if !spec::is_file_name(&file.file_name) {
            return Err(errors::invalid(
                field("file_name"),
                "1-253 of A-Za-z0-9._-, not `.` or `..`",
            ));
        }
        if file.contents.len() > MAX_CONFIGURATION_FILE {
            return Err(errors::invalid(
                field("contents"),
                format!("at most {} KiB", MAX_CONFIGURATION_FILE / 1024),
            ));
        }
        total += file.contents.len();
    }
    if total > MAX_CONFIGURATION_STAGE {
        return Err(errors::invalid(
            "files",
            format!(
                "the files hold {total} bytes together, over {} KiB",
                MAX_CONFIGURATION_STAGE / 1024
            ),
        ));
    }
    Ok(())
}

/// A request's `timeout` when it is positive; `None` otherwise (absent, zero or negative:
/// the agent's own limit applies).
pub fn requested(timeout: Option<prost_types::Duration>) -> Option<Duration> {
    timeout
        .and_then(|d| Duration::try_from(d).ok())
        .filter(|d| !d.is_zero())
}

/// How long each file of a request may run: the `requested` timeout, capped at `ceiling` (the
/// agent's own limit); otherwise `ceiling` ([X3]).
pub fn check_timeout(requested: Option<Duration>, ceiling: Duration) -> Duration {
    requested.map_or(ceiling, |d| d.min(ceiling))
}

/// How a file ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It exited with this status.
    Exited(i32),
    /// It was still running at the timeout and was killed.
    TimedOut,
}

/// A file's answer: how it `ended`, the tail of what it wrote (only the last
/// [`MAX_CHECK_OUTPUT`] bytes answered), how long it ran.
pub fn result(file: &CheckFile, ended: Ended, output: &Tail, took: Duration) -> CheckResult {
    let text = output.text();
    let (text, cut) = last_bytes(&text, MAX_CHECK_OUTPUT);
    CheckResult {
        endpoint: file.endpoint.clone(),
        file_name: file.file_name.clone(),
        exited: matches!(ended, Ended::Exited(_)),
        exit_code: match ended {
            Ended::Exited(code) => code,
            Ended::TimedOut => -1,
        },
        timed_out: ended == Ended::TimedOut,
        output: text.to_owned(),
        truncated: cut || output.dropped() > 0,
        duration: prost_types::Duration::try_from(took).ok(),
        error: String::new(),
    }
}

/// A file that could not run at all: `why` says so ([X3]).
pub fn not_run(file: &CheckFile, why: impl Into<String>) -> CheckResult {
    CheckResult {
        endpoint: file.endpoint.clone(),
        file_name: file.file_name.clone(),
        exited: false,
        exit_code: -1,
        timed_out: false,
        output: String::new(),
        truncated: false,
        duration: Some(prost_types::Duration::default()),
        error: why.into(),
    }
}

/// Runs `argv` as a local process (an agent whose endpoints are local processes, such as the
/// test agent) with `env` added and `input` on its standard input (a file's contents for
/// `sh -s` or `python3 -`, never an argument: PROTOCOL.md [V5]), for at most `timeout`: how it
/// ended, the tail of its stdout and stderr as they came (at most `kept` bytes held, whatever
/// it writes), how long it ran. It runs in a process group of its own, killed whole at the
/// timeout.
pub async fn run_process(
    argv: &[String],
    env: &[(String, String)],
    input: &[u8],
    timeout: Duration,
    kept: usize,
) -> std::io::Result<(Ended, Tail, Duration)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let started = std::time::Instant::now();
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| std::io::Error::other("no command"))?;
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id();
    if let Some(mut stdin) = child.stdin.take() {
        let input = input.to_vec();
        // Beside the reads, so that neither side waits on a full pipe; a process that exits
        // before reading all of its input closes the pipe, which is no error of the run.
        tokio::spawn(async move {
            let _ = stdin.write_all(&input).await;
        });
    }
    let mut stdout = child
        .stdout
        .take()
        .ok_or_else(|| std::io::Error::other("no stdout"))?;
    let mut stderr = child
        .stderr
        .take()
        .ok_or_else(|| std::io::Error::other("no stderr"))?;
    let mut tail = Tail::new(kept);
    let streamed = async {
        let (mut out_open, mut err_open) = (true, true);
        let (mut out_buf, mut err_buf) = (vec![0u8; 8192], vec![0u8; 8192]);
        while out_open || err_open {
            tokio::select! {
                read = stdout.read(&mut out_buf), if out_open => match read? {
                    0 => out_open = false,
                    n => tail.push(&out_buf[..n]),
                },
                read = stderr.read(&mut err_buf), if err_open => match read? {
                    0 => err_open = false,
                    n => tail.push(&err_buf[..n]),
                },
            }
        }
        child.wait().await
    };
    let ended = match tokio::time::timeout(timeout, streamed).await {
        Ok(status) => Ended::Exited(status?.code().unwrap_or(-1)),
        Err(_) => {
            // The whole group: what the file started goes with it.
            if let Some(pid) = pid {
                let _ = tokio::process::Command::new("kill")
                    .args(["-KILL", "--", &format!("-{pid}")])
                    .status()
                    .await;
            }
            let _ = child.kill().await;
            Ended::TimedOut
        }
    };
    Ok((ended, tail, started.elapsed()))
}

/// The end of `text` within `limit` bytes, cut at a character boundary; whether it was cut.
fn last_bytes(text: &str, limit: usize) -> (&str, bool) {
    if text.len() <= limit {
        return (text, false);
    }
    let mut start = text.len() - limit;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    (&text[start..], true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(endpoint: &str, name: &str, size: usize) -> CheckFile {
        CheckFile {
            endpoint: endpoint.into(),
            r#type: ConfigurationType::Shell as i32,
            file_name: name.into(),
            contents: vec![b'#'; size],
        }
    }

    fn field(status: Status) -> String {
        errors::reason(&status)
            .and_then(|(_, metadata)| metadata.get("field").cloned())
            .unwrap_or_default()
    }

    #[test]
    fn requests_breaking_a_rule_name_their_field() {
        let offered = vec!["configuration.shell".to_owned()];
        let spec = LessonSpec {
            endpoints: vec![antidote_proto::agent::v1::Endpoint {
                name: "client".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let check = |files: &[CheckFile]| check_request(files, Some(&spec), &offered);
        assert!(check(&[shell("client", "client.sh", 10)]).is_ok());
        let cases: Vec<(Vec<CheckFile>, &str)> = vec![
            (vec![], "files"),
            (vec![shell("server", "server.sh", 1)], "files[0].endpoint"),
            (
                vec![shell("client", "a.sh", 1), shell("client", "b.sh", 1)],
                "files[1].endpoint",
            ),
            (vec![shell("client", "../x", 1)], "files[0].file_name"),
            (
                vec![shell("client", "big.sh", MAX_CONFIGURATION_FILE + 1)],
                "files[0].contents",
            ),
            (
                vec![CheckFile {
                    r#type: ConfigurationType::Python as i32,
                    ..shell("client", "client.py", 1)
                }],
                "files[0].type",
            ),
            (
                vec![CheckFile {
                    r#type: ConfigurationType::Ansible as i32,
                    ..shell("client", "client.yml", 1)
                }],
                "files[0].type",
            ),
        ];
        for (files, expected) in cases {
            let refused = check(&files).expect_err(expected);
            assert_eq!(refused.code(), tonic::Code::InvalidArgument);
            assert_eq!(field(refused), expected);
        }
    }

    #[test]
    fn the_timeout_is_the_requests_within_the_ceiling() {
        let ceiling = Duration::from_secs(300);
        let asked = |s: i64| {
            requested(Some(prost_types::Duration {
                seconds: s,
                nanos: 0,
            }))
        };
        assert_eq!(check_timeout(asked(2), ceiling), Duration::from_secs(2));
        assert_eq!(check_timeout(asked(900), ceiling), ceiling);
        assert_eq!(check_timeout(asked(0), ceiling), ceiling);
        assert_eq!(check_timeout(asked(-5), ceiling), ceiling);
        assert_eq!(check_timeout(None, ceiling), ceiling);
    }

    #[tokio::test]
    async fn a_local_process_is_bounded_in_time_and_output() {
        let sh = ["sh".to_owned(), "-s".to_owned()];
        let run = |script: &str, timeout| {
            let script = script.as_bytes().to_vec();
            let sh = sh.clone();
            async move { run_process(&sh, &[], &script, timeout, 1024).await.unwrap() }
        };
        let (ended, tail, _) = run("echo out; echo err >&2; exit 4", Duration::from_secs(30)).await;
        assert_eq!(ended, Ended::Exited(4));
        assert!(tail.text().contains("out") && tail.text().contains("err"));
        // 5 MB of output, 1 KiB kept.
        let (ended, tail, _) = run(
            "head -c 5000000 /dev/zero | tr '\\0' x; echo end",
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(ended, Ended::Exited(0));
        assert!(tail.text().ends_with("end\n") && tail.dropped() > 4_000_000);
        let (ended, tail, _) = run("echo started; sleep 600", Duration::from_millis(500)).await;
        assert_eq!(ended, Ended::TimedOut);
        assert!(tail.text().contains("started"));
        // Input over what one argument may hold (128 KiB) reaches the shell whole.
        let mut big = "#".repeat(300 * 1024);
        big.push_str("\necho all of it\n");
        let (ended, tail, _) = run(&big, Duration::from_secs(30)).await;
        assert_eq!(ended, Ended::Exited(0));
        assert!(tail.text().contains("all of it"), "{:?}", tail.text());
    }

    #[test]
    fn only_the_end_of_the_output_is_answered() {
        let file = shell("client", "client.sh", 1);
        let mut tail = Tail::new(64 * 1024);
        for _ in 0..10_000 {
            tail.push("ünïcödé line of output\n".as_bytes());
        }
        tail.push(b"the last line\n");
        let answer = result(&file, Ended::Exited(1), &tail, Duration::from_millis(5));
        assert!(answer.output.len() <= MAX_CHECK_OUTPUT);
        assert!(answer.output.ends_with("the last line\n"));
        assert!(answer.truncated);
        assert!(answer.exited && answer.exit_code == 1 && !answer.timed_out);
        let short = result(&file, Ended::TimedOut, &Tail::new(1024), Duration::ZERO);
        assert!(short.timed_out && !short.exited && !short.truncated);
    }
}
