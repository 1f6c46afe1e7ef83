//! Commands that read their standard input. A child may exit before it read all of it (a
//! refusal: no token, a bad argument), and writing to it then fails with BrokenPipe: that is
//! no failure of the test, which asserts on what the child printed and its exit status.

use std::io::ErrorKind;
use std::process::{Output, Stdio};
use std::time::Duration;

use anyhow::Context as _;

/// Runs `command` with `input` on its stdin (then closed) and returns its output; gives up
/// after `limit` (a guard against hangs).
pub async fn output_with_input(
    command: std::process::Command,
    input: &[u8],
    limit: Duration,
) -> anyhow::Result<Output> {
    let mut command = tokio::process::Command::from(command);
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().context("the command starts")?;
    let mut stdin = child.stdin.take().context("stdin is piped")?;
    let feed = async move {
        let written = tokio::io::AsyncWriteExt::write_all(&mut stdin, input).await;
        drop(stdin);
        unless_gone(written)
    };
    let (fed, output) = tokio::time::timeout(limit, async {
        tokio::join!(feed, child.wait_with_output())
    })
    .await
    .with_context(|| format!("the command did not end within {limit:?}"))?;
    fed.context("writing the command's input")?;
    Ok(output?)
}

/// [`output_with_input`] for synchronous callers (no deadline: for short tools like openssl).
pub fn output_with_input_blocking(
    mut command: std::process::Command,
    input: &[u8],
) -> anyhow::Result<Output> {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("the command starts")?;
    let mut stdin = child.stdin.take().context("stdin is piped")?;
    // Written beside the reads, so neither side waits on a full pipe.
    let output = std::thread::scope(|scope| {
        let fed = scope.spawn(move || unless_gone(std::io::Write::write_all(&mut stdin, input)));
        let output = child.wait_with_output();
        let fed = fed.join().expect("the writer does not panic");
        fed.map(|()| output)
    });
    Ok(output.context("writing the command's input")??)
}

/// A write's result, where the reader having exited (BrokenPipe) counts as done.
fn unless_gone(written: std::io::Result<()>) -> std::io::Result<()> {
    match written {
        Err(err) if err.kind() == ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sh -c 'exit 3'` never reads: a megabyte of input (more than a pipe holds) meets a
    /// closed pipe, and the exit status is still what the test gets.
    #[tokio::test]
    async fn a_child_that_exits_without_reading_is_no_error() {
        let input = vec![b'x'; 1 << 20];
        let mut command = std::process::Command::new("sh");
        command.args(["-c", "echo refused >&2; exit 3"]);
        let output = output_with_input(command, &input, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(output.status.code(), Some(3));
        assert_eq!(String::from_utf8_lossy(&output.stderr), "refused\n");

        let mut command = std::process::Command::new("sh");
        command.args(["-c", "exit 4"]);
        let output = output_with_input_blocking(command, &input).unwrap();
        assert_eq!(output.status.code(), Some(4));
    }

    #[tokio::test]
    async fn a_child_that_reads_gets_all_of_its_input() {
        let input = vec![b'y'; 1 << 20];
        let mut command = std::process::Command::new("wc");
        command.arg("-c");
        let output = output_with_input(command, &input, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "1048576");
        let mut command = std::process::Command::new("wc");
        command.arg("-c");
        let output = output_with_input_blocking(command, &input).unwrap();
        assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "1048576");
    }
}
