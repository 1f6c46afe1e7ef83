//! What a stage's configuration run leaves: how it ended ([`Run`]) and the bounded tail of its
//! output ([`Tail`]), the same for every backend, so FAILED reasons read alike whichever agent
//! ran the script.

/// How much of a configuration run's output is kept: the last 64 KiB (older bytes are dropped
/// as new ones arrive, so a script printing without end costs the agent no more than this).
pub const OUTPUT_KEPT: usize = 64 * 1024;

/// How much of a failed run's output a FAILED reason quotes (less than [`OUTPUT_KEPT`]:
/// reasons are stored and shown with every event).
pub const REASON_TAIL: usize = 1024;

/// How a configuration run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Run {
    /// It exited with this code.
    Exited(i64),
    /// It was still going when its time was up, and was killed.
    TimedOut,
}

/// The last bytes of a stream: at most `limit` are kept, older ones are dropped as new ones
/// arrive, so that memory stays bounded whatever a script prints.
#[derive(Debug)]
pub struct Tail {
    /// The kept bytes, oldest first.
    kept: std::collections::VecDeque<u8>,
    /// The most bytes kept.
    limit: usize,
    /// How many bytes were dropped from the front.
    dropped: u64,
}

impl Tail {
    /// An empty tail keeping at most `limit` bytes.
    pub fn new(limit: usize) -> Tail {
        Tail {
            kept: std::collections::VecDeque::new(),
            limit,
            dropped: 0,
        }
    }

    /// Appends `bytes`, dropping the oldest beyond the limit.
    pub fn push(&mut self, bytes: &[u8]) {
        if bytes.len() >= self.limit {
            self.dropped += (self.kept.len() + bytes.len() - self.limit) as u64;
            self.kept.clear();
            self.kept.extend(&bytes[bytes.len() - self.limit..]);
            return;
        }
        self.kept.extend(bytes);
        let over = self.kept.len().saturating_sub(self.limit);
        if over > 0 {
            self.kept.drain(..over);
            self.dropped += over as u64;
        }
    }

    /// The kept bytes as text (invalid UTF-8, such as a character cut at the front, replaced).
    pub fn text(&self) -> String {
        let (front, back) = self.kept.as_slices();
        let mut bytes = Vec::with_capacity(self.kept.len());
        bytes.extend_from_slice(front);
        bytes.extend_from_slice(back);
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// How many bytes were dropped from the front.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// The pid line a configuration run's wrapper prints on stderr before anything else (agents
/// start every run as `echo $$ >&2; …`), so that a run still going at its timeout can be
/// killed: an exec, in Docker as in Kubernetes, has no stop of its own.
#[derive(Debug, Default)]
pub struct PidLine {
    /// Bytes of the line so far; None once it has been read (or given up on).
    line: Option<Vec<u8>>,
    /// The pid, once read.
    pid: Option<u32>,
}

impl PidLine {
    /// Waiting for the pid line.
    pub fn new() -> PidLine {
        PidLine {
            line: Some(Vec::new()),
            pid: None,
        }
    }

    /// Takes the pid line from the front of stderr; the rest of `message` goes to `tail`.
    pub fn feed(&mut self, message: &[u8], tail: &mut Tail) {
        let Some(line) = self.line.as_mut() else {
            tail.push(message);
            return;
        };
        match message.iter().position(|b| *b == b'\n') {
            Some(end) => {
                line.extend_from_slice(&message[..end]);
                self.pid = std::str::from_utf8(line)
                    .ok()
                    .and_then(|l| l.trim().parse().ok());
                self.line = None;
                tail.push(&message[end + 1..]);
            }
            None if line.len() + message.len() > 32 => {
                // Not our pid line after all: keep it as output.
                tail.push(line);
                tail.push(message);
                self.line = None;
            }
            None => line.extend_from_slice(message),
        }
    }
}

impl PidLine {
    /// The pid, once its line was read.
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }
}

/// The last `max` bytes of `text`, trimmed, cut at a character boundary and marked with `…`
/// when something was cut.
pub fn tail(text: &str, max: usize) -> String {
    let text = text.trim();
    if text.len() <= max {
        return text.to_owned();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

/// A failed try in the words of a FAILED reason: `exit code N: <output tail>`, or that it was
/// killed at `timeout` with the tail its output ended on.
pub fn failed_try(run: Run, output: &Tail, timeout: std::time::Duration) -> String {
    match run {
        Run::Exited(code) => format!("exit code {code}: {}", tail(&output.text(), REASON_TAIL)),
        Run::TimedOut => format!(
            "did not finish within {timeout:?} and was killed; output ends: {}",
            tail(&output.text(), REASON_TAIL)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_keeps_only_the_last_bytes() {
        let mut tail = Tail::new(8);
        tail.push(b"abc");
        tail.push(b"defgh");
        assert_eq!((tail.text().as_str(), tail.dropped()), ("abcdefgh", 0));
        tail.push(b"ij");
        assert_eq!((tail.text().as_str(), tail.dropped()), ("cdefghij", 2));
        tail.push(b"0123456789");
        assert_eq!((tail.text().as_str(), tail.dropped()), ("23456789", 12));
        // A million small writes never hold more than the limit.
        for _ in 0..1_000_000 {
            tail.push(b"xyz");
        }
        assert_eq!(tail.kept.len(), 8);
        assert_eq!(tail.dropped(), 12 + 3_000_000);
    }

    #[test]
    fn the_pid_line_is_taken_from_the_front_of_stderr() {
        let mut tail = Tail::new(64);
        let mut pid = PidLine::new();
        pid.feed(b"4", &mut tail);
        pid.feed(b"2\nfirst words", &mut tail);
        pid.feed(b" and more\n", &mut tail);
        assert_eq!(pid.pid, Some(42));
        assert_eq!(tail.text(), "first words and more\n");

        // Anything else is output, not lost.
        let mut tail = Tail::new(64);
        let mut pid = PidLine::new();
        pid.feed(
            b"sh: something went wrong before the wrapper ran",
            &mut tail,
        );
        assert_eq!(pid.pid, None);
        assert!(tail.text().starts_with("sh: something"), "{}", tail.text());
    }

    #[test]
    fn a_tail_keeps_the_last_bytes_and_counts_the_rest() {
        let mut t = Tail::new(4);
        t.push(b"ab");
        t.push(b"cdef");
        assert_eq!(t.text(), "cdef");
        assert_eq!(t.dropped(), 2);
        t.push(b"0123456789");
        assert_eq!(t.text(), "6789");
        assert_eq!(t.dropped(), 12);
        assert_eq!(tail("  héllo  ", 3), "…llo");
        assert_eq!(tail("hé", 1), "…");
        assert_eq!(tail("ok", 10), "ok");
        assert_eq!(
            failed_try(Run::Exited(2), &t, std::time::Duration::from_secs(1)),
            "exit code 2: 6789"
        );
    }
}
