//! A hand-written NATS client connection for sending what a well-behaved client library will not:
//! header blocks that break the header grammar and subjects that are not UTF-8 (issue 12, item
//! 1). Only `CONNECT`, `HPUB`, `PUB`, `SUB`/`UNSUB` (to see what the server permits; it never
//! reads the messages) and a `PING`/`PONG` round trip.
//!
//! # Pitfalls
//!
//! - The server forwards a header block verbatim; it only checks the byte counts. What a block
//!   does to a subscriber is decided by the subscriber's client library.
//! - [`RawConnection::round_trip`] is the only way to know the server has processed what was
//!   written before it (and whether it answered `-ERR`); a publish alone returns before that.

use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// One raw client connection (no echo, headers on, not verbose).
#[derive(Debug)]
pub struct RawConnection {
    stream: BufReader<TcpStream>,
}

impl RawConnection {
    /// Connects to `127.0.0.1:port`, optionally as `user`/`password`, and waits for the server
    /// to accept the `CONNECT`.
    pub async fn connect(port: u16, credentials: Option<(&str, &str)>) -> RawConnection {
        let stream = tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(("127.0.0.1", port)))
            .await
            .expect("raw connect timed out")
            .expect("raw connect");
        // Many small writes, each waiting for a PONG: no Nagle delay.
        stream.set_nodelay(true).expect("TCP_NODELAY");
        let mut raw = RawConnection {
            stream: BufReader::new(stream),
        };
        let info = raw.read_line().await;
        assert!(info.starts_with("INFO "), "server greeting: {info}");
        let mut connect = serde_json::json!({
            "verbose": false, "pedantic": false, "headers": true, "no_responders": true,
            "protocol": 1, "echo": false, "lang": "raw", "version": "0", "name": "raw",
        });
        if let Some((user, pass)) = credentials {
            connect["user"] = user.into();
            connect["pass"] = pass.into();
        }
        raw.write(format!("CONNECT {connect}\r\n").as_bytes()).await;
        let errors = raw.round_trip().await;
        assert!(errors.is_empty(), "CONNECT refused: {errors:?}");
        raw
    }

    /// Writes `HPUB subject [reply] <header len> <total len>` with `header` and `payload` as
    /// given, byte for byte.
    pub async fn hpub(
        &mut self,
        subject: &str,
        reply: Option<&str>,
        header: &[u8],
        payload: &[u8],
    ) {
        let reply = reply.map(|r| format!(" {r}")).unwrap_or_default();
        let mut frame = format!(
            "HPUB {subject}{reply} {} {}\r\n",
            header.len(),
            header.len() + payload.len()
        )
        .into_bytes();
        frame.extend_from_slice(header);
        frame.extend_from_slice(payload);
        frame.extend_from_slice(b"\r\n");
        self.write(&frame).await;
    }

    /// Writes `PUB subject [reply] <len>` with `subject` and `reply` byte for byte: they need
    /// not be UTF-8 (the server forwards any bytes in a subject).
    pub async fn publish(&mut self, subject: &[u8], reply: Option<&[u8]>, payload: &[u8]) {
        let mut frame = b"PUB ".to_vec();
        frame.extend_from_slice(subject);
        if let Some(reply) = reply {
            frame.push(b' ');
            frame.extend_from_slice(reply);
        }
        frame.extend_from_slice(format!(" {}\r\n", payload.len()).as_bytes());
        frame.extend_from_slice(payload);
        frame.extend_from_slice(b"\r\n");
        self.write(&frame).await;
    }

    /// Writes `SUB subject sid`. The connection never reads messages: subscribe only to learn
    /// whether the server permits it ([`RawConnection::round_trip`]), then
    /// [`RawConnection::unsubscribe`].
    pub async fn subscribe(&mut self, subject: &str, sid: u64) {
        self.write(format!("SUB {subject} {sid}\r\n").as_bytes())
            .await;
    }

    /// Writes `UNSUB sid`.
    pub async fn unsubscribe(&mut self, sid: u64) {
        self.write(format!("UNSUB {sid}\r\n").as_bytes()).await;
    }

    /// `PING`, then reads up to the `PONG`: the `-ERR` lines the server sent meanwhile.
    pub async fn round_trip(&mut self) -> Vec<String> {
        self.write(b"PING\r\n").await;
        let mut errors = Vec::new();
        loop {
            let line = self.read_line().await;
            match line.as_str() {
                "PONG" => return errors,
                "PING" => self.write(b"PONG\r\n").await,
                other if other.starts_with("-ERR") => errors.push(other.to_owned()),
                _ => {}
            }
        }
    }

    async fn write(&mut self, bytes: &[u8]) {
        tokio::time::timeout(IO_TIMEOUT, self.stream.get_mut().write_all(bytes))
            .await
            .expect("raw write timed out")
            .expect("raw write");
    }

    async fn read_line(&mut self) -> String {
        let mut line = String::new();
        let n = tokio::time::timeout(IO_TIMEOUT, self.stream.read_line(&mut line))
            .await
            .expect("raw read timed out")
            .expect("raw read");
        assert!(n > 0, "the server closed the raw connection");
        line.trim_end().to_owned()
    }
}

/// Header blocks that break the NATS header grammar, each with what is wrong with it: the cases
/// of issue 12, item 1, plus a lone carriage return inside a value. A subscriber must lose at
/// most the one message (its headers), never its connection.
pub const MALFORMED_HEADER_BLOCKS: &[(&str, &[u8])] = &[
    (
        "a header name with a space",
        b"NATS/1.0\r\nBad Name: v\r\n\r\n",
    ),
    ("no NATS/1.0 line", b"Cyrene-Test: v\r\n\r\n"),
    (
        "a line without a colon",
        b"NATS/1.0\r\nno colon here\r\n\r\n",
    ),
    ("junk in the status line", b"NATS/1.0 x?! junk\r\n\r\n"),
    (
        "a non-UTF-8 value",
        b"NATS/1.0\r\nCyrene-Test: \xff\xfe\r\n\r\n",
    ),
    (
        "a lone CR inside a value",
        b"NATS/1.0\r\nCyrene-Test: a\rb\r\n\r\n",
    ),
    (
        "a non-ASCII header name",
        b"NATS/1.0\r\nCyr\xc3\xa9ne: v\r\n\r\n",
    ),
];
