//! What counts as a learner's activity in a proxied WebSocket: its data frames (text, binary
//! and their continuations) from the learner, never control frames. A server's pings are
//! answered by the browser with pongs on its own, and a close is no activity either, so an
//! open but idle tab (a Jupyter page whose server pings) keeps nothing alive.

/// Reads the learner → backend byte stream of a WebSocket frame by frame (RFC 6455 5.2):
/// headers are parsed, payloads skipped.
#[derive(Debug, Default)]
pub struct Frames {
    /// The header read so far (at most 2 + 8 + 4 bytes).
    header: [u8; 14],
    /// How many bytes of it.
    have: usize,
    /// Payload bytes of the current frame still to come.
    payload: u64,
}

impl Frames {
    /// Takes the next bytes from the learner; whether they hold a data frame's header (so the
    /// learner sent data: a keystroke, a message), not only control frames or the rest of a
    /// frame already counted.
    pub fn feed(&mut self, mut bytes: &[u8]) -> bool {
        let mut data = false;
        while !bytes.is_empty() {
            if self.payload > 0 {
                let n = self.payload.min(bytes.len() as u64) as usize;
                self.payload -= n as u64;
                bytes = &bytes[n..];
                continue;
            }
            self.header[self.have] = bytes[0];
            self.have += 1;
            bytes = &bytes[1..];
            if self.have < 2 {
                continue;
            }
            let len7 = self.header[1] & 0x7f;
            let extended = match len7 {
                126 => 2,
                127 => 8,
                _ => 0,
            };
            let mask = if self.header[1] & 0x80 != 0 { 4 } else { 0 };
            if self.have < 2 + extended + mask {
                continue;
            }
            self.payload = match extended {
                0 => u64::from(len7),
                2 => u64::from(u16::from_be_bytes([self.header[2], self.header[3]])),
                _ => u64::from_be_bytes(self.header[2..10].try_into().expect("8 bytes")),
            };
            // Opcodes 0x0 (continuation), 0x1 (text), 0x2 (binary) carry data; 0x8 and up are
            // control frames (close, ping, pong).
            if self.header[0] & 0x0f < 0x8 {
                data = true;
            }
            self.have = 0;
        }
        data
    }
}

#[cfg(test)]
mod tests {
    use super::Frames;

    /// A masked client frame (as browsers send them).
    fn frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0x80 | opcode];
        match payload.len() {
            n if n < 126 => out.push(0x80 | n as u8),
            n if n <= usize::from(u16::MAX) => {
                out.push(0x80 | 126);
                out.extend((n as u16).to_be_bytes());
            }
            n => {
                out.push(0x80 | 127);
                out.extend((n as u64).to_be_bytes());
            }
        }
        let mask = [1u8, 2, 3, 4];
        out.extend(mask);
        out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        out
    }

    #[test]
    fn only_data_frames_from_the_learner_count() {
        let mut frames = Frames::default();
        // A pong answering the server's ping, a ping of the browser's own, a close: nothing.
        assert!(!frames.feed(&frame(0xA, b"keepalive")));
        assert!(!frames.feed(&frame(0x9, b"")));
        // A keystroke (binary), a message (text): activity.
        assert!(frames.feed(&frame(0x2, b"l")));
        assert!(frames.feed(&frame(0x1, br#"{"type":"input","data":"s\r"}"#)));
        // A pong whose payload looks like a data frame's header is skipped whole.
        assert!(!frames.feed(&frame(0xA, &frame(0x1, b"fake"))));
        // Frames split anywhere, headers included, and several in one read.
        let mut stream = frame(0xA, b"p");
        stream.extend(frame(0x2, &vec![7u8; 300]));
        stream.extend(frame(0x0, &vec![8u8; 70_000]));
        stream.extend(frame(0xA, b"q"));
        let (pong, rest) = stream.split_at(3);
        assert!(!frames.feed(pong), "half a pong");
        let (rest, last_pong) = rest.split_at(rest.len() - frame(0xA, b"q").len());
        let mut counted = false;
        for chunk in rest.chunks(5) {
            counted |= frames.feed(chunk);
        }
        assert!(
            counted,
            "a 300-byte binary frame and a 70,000-byte continuation"
        );
        assert!(
            !frames.feed(last_pong),
            "the payload was skipped, this is a pong"
        );
        assert!(!frames.feed(&frame(0x8, &1000u16.to_be_bytes())));
    }
}
