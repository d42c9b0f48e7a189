//! Blocking readiness probes: the client port's `INFO` line and the monitoring
//! port's HTTP endpoints. No runtime needed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const IO_TIMEOUT: Duration = Duration::from_secs(1);

fn connect(port: u16) -> std::io::Result<TcpStream> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(stream)
}

/// True when a TCP connection to the client port succeeds and the server
/// greets it with its `INFO` line.
pub(crate) fn client_port_ready(port: u16) -> bool {
    let Ok(stream) = connect(port) else {
        return false;
    };
    let mut line = String::new();
    match BufReader::new(stream).read_line(&mut line) {
        Ok(_) => line.starts_with("INFO "),
        Err(_) => false,
    }
}

/// `GET path` on the monitoring port: `(status code, body)`.
pub(crate) fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = connect(port).ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// True when `GET path` answers 200.
pub(crate) fn http_ok(port: u16, path: &str) -> bool {
    matches!(http_get(port, path), Some((200, _)))
}

/// `GET path` parsed as JSON, when it answers 200.
pub(crate) fn http_json(port: u16, path: &str) -> Option<serde_json::Value> {
    match http_get(port, path)? {
        (200, body) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}
