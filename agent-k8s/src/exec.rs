//! Shell configurations and shell check files run inside the endpoint's own container, through
//! the API server's `pods/exec` (a WebSocket to the kubelet), as agent-docker runs them by
//! `docker exec`: the script acts on the endpoint's network namespace (its Multus links),
//! filesystem and processes, which a Job in a pod of its own could never touch. Python check
//! files run the same way inside the configurator pod of a run ([`python`]).
//!
//! The script goes through the exec's stdin into a file inside the container, never on its
//! command line (the kubelet's URL and every audit log would hold it, and Linux bounds one
//! argument to 128 KiB). The wrapper prints its pid on stderr's first line, so that a run still
//! going at its timeout can be killed with everything it started: an exec has no stop of its
//! own, and closing its stream leaves the process running.

use std::time::Duration;

use antidote_sdk::output::{OUTPUT_KEPT, PidLine, Run, Tail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::api::{Api, AttachParams};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The command an exec starts: it reports its pid, writes stdin (the script) to a temporary
/// file, runs it with stdin closed and `ANTIDOTE_ENDPOINT`/`ANTIDOTE_STAGE` set ($1 and $2),
/// removes the file and exits with the script's status.
const WRAPPER: &str = r#"echo $$ >&2
f=$(mktemp 2>/dev/null) || f=/tmp/antidote-config.$$
cat >"$f" || exit 126
ANTIDOTE_ENDPOINT="$1" ANTIDOTE_STAGE="$2" sh "$f" </dev/null
rc=$?
rm -f "$f"
exit $rc"#;

/// [`WRAPPER`] for a python file in the configurator: stdin holds the endpoint's configuration
/// user and password (a line each), then the file; it runs under `python3` with a python
/// configuration's environment: the endpoint by name (`ANTIDOTE_HOST`, $1), the stage ($2),
/// the credentials (never on a command line).
const PYTHON_WRAPPER: &str = r#"echo $$ >&2
IFS= read -r user || exit 126
IFS= read -r password || exit 126
f=$(mktemp 2>/dev/null) || f=/tmp/antidote-check.$$
cat >"$f" || exit 126
ANTIDOTE_HOST="$1" ANTIDOTE_ENDPOINT="$1" ANTIDOTE_STAGE="$2" ANTIDOTE_CONFIG_USER="$user" \
ANSIBLE_REMOTE_USER="$user" ANTIDOTE_CONFIG_PASSWORD="$password" python3 "$f" </dev/null
rc=$?
rm -f "$f"
exit $rc"#;

/// Kills the process $1 and every descendant, found through /proc (a pure-shell walk: the
/// images are minimal, and `pkill` or `setsid` may be missing), and its process group (the
/// kubelet's exec starts the wrapper as a session and group leader, so the group holds what
/// the run started in the background, even once reparented). Twice, for what forked between.
const KILL_TREE: &str = r#"tree() {
  local d l r pp
  echo "$1"
  for d in /proc/[0-9]*; do
    read -r l <"$d/stat" 2>/dev/null || continue
    r=${l##*) }
    pp=${r#* }
    pp=${pp%% *}
    [ "$pp" = "$1" ] && tree "${d#/proc/}"
  done
}
for round in 1 2; do
  kill -KILL -- "-$1" 2>/dev/null || kill -KILL "-$1" 2>/dev/null
  kill -KILL $(tree "$1") 2>/dev/null
done
exit 0"#;

/// Why an exec could not run (not why a script failed: that is a [`Run`]).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The API server or the kubelet refused or broke the exec.
    #[error("exec in pod `{pod}`: {source}")]
    Kube {
        /// The pod.
        pod: String,
        /// What kube-rs said.
        #[source]
        source: kube::Error,
    },
    /// The container could not start the command (no `sh` in the image, say).
    #[error("exec in pod `{pod}` could not run the shell: {message}")]
    Start {
        /// The pod.
        pod: String,
        /// The kubelet's words.
        message: String,
    },
}

/// Runs `script` in container `container` of pod `pod` for at most `timeout`, with
/// `ANTIDOTE_ENDPOINT` and `ANTIDOTE_STAGE` set. Returns how it ended and the last
/// [`OUTPUT_KEPT`] bytes of its combined output; a run still going at the timeout is killed
/// with its descendants.
pub async fn shell(
    pods: &Api<Pod>,
    pod: &str,
    container: &str,
    script: &[u8],
    env: (&str, &str),
    timeout: Duration,
) -> Result<(Run, Tail), ExecError> {
    let command = ["sh", "-c", WRAPPER, "antidote-config", env.0, env.1];
    run(pods, pod, container, &command, script, timeout).await
}

/// Runs python `script` in the configurator container `container` of pod `pod` against
/// endpoint `endpoint` (by its name, with its configuration `credentials`: user, password) at
/// stage `stage`, for at most `timeout`, as [`shell`] runs a script.
pub async fn python(
    pods: &Api<Pod>,
    pod: &str,
    container: &str,
    script: &[u8],
    (endpoint, stage): (&str, &str),
    (user, password): (&str, &str),
    timeout: Duration,
) -> Result<(Run, Tail), ExecError> {
    let mut input = Vec::with_capacity(user.len() + password.len() + 2 + script.len());
    for line in [user, password] {
        input.extend_from_slice(line.as_bytes());
        input.push(b'\n');
    }
    input.extend_from_slice(script);
    let command = [
        "sh",
        "-c",
        PYTHON_WRAPPER,
        "antidote-check",
        endpoint,
        stage,
    ];
    run(pods, pod, container, &command, &input, timeout).await
}

/// Runs `command` (a wrapper that prints its pid first on stderr) in container `container` of
/// pod `pod` with `input` on its stdin, for at most `timeout`: how it ended and the last
/// [`OUTPUT_KEPT`] bytes of its combined output, the pid line left out; at the timeout the
/// wrapper is killed with what it started.
async fn run(
    pods: &Api<Pod>,
    pod: &str,
    container: &str,
    command: &[&str],
    input: &[u8],
    timeout: Duration,
) -> Result<(Run, Tail), ExecError> {
    let params = with_stdin(container);
    let kube = |source| ExecError::Kube {
        pod: pod.to_owned(),
        source,
    };
    let mut attached = pods
        .exec(pod, command.iter().copied(), &params)
        .await
        .map_err(kube)?;
    let (Some(mut stdin), Some(mut stdout), Some(mut stderr), Some(status)) = (
        attached.stdin(),
        attached.stdout(),
        attached.stderr(),
        attached.take_status(),
    ) else {
        // All four were asked for above, so kube-rs hands each out once.
        unreachable!("an exec with stdin, stdout and stderr has all three and a status");
    };
    let output = std::sync::Mutex::new(Tail::new(OUTPUT_KEPT));
    let mut pid = PidLine::new();
    let mut dropped = KillOnDrop {
        pods: pods.clone(),
        pod: pod.to_owned(),
        container: container.to_owned(),
        pid: std::sync::atomic::AtomicU32::new(0),
        armed: true,
    };
    let run = async {
        let feed = async {
            // A script that never reads stdin still gets all of it (the wrapper's `cat` does),
            // so this write ends; a failure here shows as the run's own failure below.
            let _ = stdin.write_all(input).await;
            let _ = stdin.shutdown().await;
            drop(stdin);
        };
        let out = async {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n @ 1..) = stdout.read(&mut buf).await {
                lock(&output).push(&buf[..n]);
            }
        };
        let err = async {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n @ 1..) = stderr.read(&mut buf).await {
                pid.feed(&buf[..n], &mut lock(&output));
                if let Some(pid) = pid.pid() {
                    dropped.pid.store(pid, std::sync::atomic::Ordering::Relaxed);
                }
            }
        };
        let ((), (), ()) = tokio::join!(feed, out, err);
        status.await
    };
    let ended = tokio::time::timeout(timeout, run).await;
    // Ended here, one way or the other: the branches below kill what needs killing.
    dropped.armed = false;
    let output = output.into_inner().unwrap_or_else(|e| e.into_inner());
    match ended {
        Ok(status) => {
            attached.abort();
            match exit_code(status.as_ref()) {
                Ok(code) => Ok((Run::Exited(code), output)),
                Err(message) => Err(ExecError::Start {
                    pod: pod.to_owned(),
                    message,
                }),
            }
        }
        Err(_) => {
            attached.abort();
            match pid.pid() {
                Some(pid) if pid > 1 => kill_tree(pods, pod, container, pid).await,
                _ => tracing::warn!(pod, "a timed-out run left no pid to kill"),
            }
            Ok((Run::TimedOut, output))
        }
    }
}

/// A run's process tree, killed in the background if the run is dropped before it ends (the
/// call that asked for it was cancelled, say a RunChecks whose client went away): a process
/// started by an exec outlives the exec's stream.
struct KillOnDrop {
    pods: Api<Pod>,
    pod: String,
    container: String,
    /// The wrapper's pid once it said it (0 before).
    pid: std::sync::atomic::AtomicU32,
    /// Whether the run is still going (then a drop kills it).
    armed: bool,
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let pid = self.pid.load(std::sync::atomic::Ordering::Relaxed);
        if !self.armed || pid <= 1 {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (pods, pod, container) = (
            self.pods.clone(),
            std::mem::take(&mut self.pod),
            std::mem::take(&mut self.container),
        );
        tracing::info!(
            pod,
            pid,
            "a run was dropped before it ended; killing what it started"
        );
        runtime.spawn(async move { kill_tree(&pods, &pod, &container, pid).await });
    }
}

/// An exec in `container` with stdin, stdout and stderr and no terminal, its pipes holding
/// 64 KiB each (kube-rs's 1 KiB default would cut a script or notebook into many small frames).
fn with_stdin(container: &str) -> AttachParams {
    AttachParams {
        container: Some(container.to_owned()),
        stdin: true,
        stdout: true,
        stderr: true,
        tty: false,
        max_stdin_buf_size: Some(64 * 1024),
        max_stdout_buf_size: Some(64 * 1024),
        max_stderr_buf_size: Some(64 * 1024),
    }
}

/// The output tail, whichever stream's task holds it last (a poisoned lock still holds
/// bytes worth keeping).
fn lock(tail: &std::sync::Mutex<Tail>) -> std::sync::MutexGuard<'_, Tail> {
    tail.lock().unwrap_or_else(|e| e.into_inner())
}

/// The exit code an exec's final status carries: `Success` is 0, `NonZeroExitCode` names the
/// code in its causes; anything else (the command could not start, the stream broke before a
/// status came) is an error with the kubelet's words.
fn exit_code(status: Option<&Status>) -> Result<i64, String> {
    let Some(status) = status else {
        return Err("the exec's stream ended without an exit status".into());
    };
    if status.status.as_deref() == Some("Success") {
        return Ok(0);
    }
    if status.reason.as_deref() == Some("NonZeroExitCode")
        && let Some(code) = status
            .details
            .as_ref()
            .and_then(|d| d.causes.as_ref())
            .into_iter()
            .flatten()
            .find(|c| c.reason.as_deref() == Some("ExitCode"))
            .and_then(|c| c.message.as_deref()?.parse().ok())
    {
        return Ok(code);
    }
    Err(status
        .message
        .clone()
        .unwrap_or_else(|| format!("{status:?}")))
}

/// Writes `contents` to `path` inside container `container` of pod `pod` (through stdin, then
/// renamed into place, so a reader never sees half a file), within 30 s.
pub async fn put(
    pods: &Api<Pod>,
    pod: &str,
    container: &str,
    path: &str,
    contents: &[u8],
) -> Result<(), ExecError> {
    let params = with_stdin(container);
    let command = [
        "sh",
        "-c",
        r#"cat >"$1.antidote-tmp" && mv -f "$1.antidote-tmp" "$1""#,
        "antidote-put",
        path,
    ];
    let kube = |source| ExecError::Kube {
        pod: pod.to_owned(),
        source,
    };
    let write = async {
        let mut attached = pods.exec(pod, command, &params).await.map_err(kube)?;
        let (Some(mut stdin), Some(mut stdout), Some(mut stderr), Some(status)) = (
            attached.stdin(),
            attached.stdout(),
            attached.stderr(),
            attached.take_status(),
        ) else {
            unreachable!("an exec with stdin, stdout and stderr has all three and a status");
        };
        let mut said = Vec::new();
        let feed = async {
            let _ = stdin.write_all(contents).await;
            let _ = stdin.shutdown().await;
            drop(stdin);
        };
        let mut sink = Vec::new();
        let (_, _, _) = tokio::join!(
            feed,
            stdout.read_to_end(&mut sink),
            stderr.read_to_end(&mut said)
        );
        let status = status.await;
        attached.abort();
        match exit_code(status.as_ref()) {
            Ok(0) => Ok(()),
            Ok(code) => Err(ExecError::Start {
                pod: pod.to_owned(),
                message: format!(
                    "writing {path} exited with {code}: {}",
                    String::from_utf8_lossy(&said).trim()
                ),
            }),
            Err(message) => Err(ExecError::Start {
                pod: pod.to_owned(),
                message,
            }),
        }
    };
    tokio::time::timeout(Duration::from_secs(30), write)
        .await
        .unwrap_or_else(|_| {
            Err(ExecError::Start {
                pod: pod.to_owned(),
                message: format!("writing {path} did not finish within 30 s"),
            })
        })
}

/// Kills a timed-out run and what it started, by a second exec (best effort, bounded).
async fn kill_tree(pods: &Api<Pod>, pod: &str, container: &str, pid: u32) {
    let params = AttachParams {
        container: Some(container.to_owned()),
        stdin: false,
        stdout: true,
        stderr: true,
        tty: false,
        ..AttachParams::default()
    };
    let pid = pid.to_string();
    let kill = async {
        let mut attached = pods
            .exec(pod, ["sh", "-c", KILL_TREE, "antidote-kill", &pid], &params)
            .await?;
        if let Some(status) = attached.take_status() {
            status.await;
        }
        Ok::<_, kube::Error>(())
    };
    match tokio::time::timeout(Duration::from_secs(10), kill).await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => {
            tracing::warn!(pod, error = %err, "could not kill a timed-out configuration run")
        }
        Err(_) => tracing::warn!(pod, "killing a timed-out configuration run timed out"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{StatusCause, StatusDetails};

    #[test]
    fn exit_codes_come_from_the_final_status() {
        let success = Status {
            status: Some("Success".into()),
            ..Status::default()
        };
        assert_eq!(exit_code(Some(&success)), Ok(0));
        let failed = Status {
            status: Some("Failure".into()),
            reason: Some("NonZeroExitCode".into()),
            message: Some("command terminated with non-zero exit code: exit status 2".into()),
            details: Some(StatusDetails {
                causes: Some(vec![StatusCause {
                    reason: Some("ExitCode".into()),
                    message: Some("2".into()),
                    ..StatusCause::default()
                }]),
                ..StatusDetails::default()
            }),
            ..Status::default()
        };
        assert_eq!(exit_code(Some(&failed)), Ok(2));
        let no_shell = Status {
            status: Some("Failure".into()),
            reason: Some("InternalError".into()),
            message: Some("exec: \"sh\": executable file not found in $PATH".into()),
            ..Status::default()
        };
        assert!(
            exit_code(Some(&no_shell))
                .unwrap_err()
                .contains("not found")
        );
        assert!(exit_code(None).is_err());
    }
}
