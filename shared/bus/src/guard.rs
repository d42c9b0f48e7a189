//! The payload size guard: an oversized payload is refused with `too_large` before any work.

use cyrene_protocol::{ErrorBody, ErrorCode};

/// The default largest request body a Cyrene endpoint accepts (the nats-server default
/// `max_payload` is 1 MiB; the guard keeps endpoints honest even where the server allows more).
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// The largest message `client`'s connection carries: the server's `max_payload` when known, else
/// the NATS default (1 MiB).
pub fn max_payload(client: &async_nats::Client) -> usize {
    match client.server_info().max_payload {
        0 => DEFAULT_MAX_PAYLOAD,
        known => known,
    }
}

/// Refuses `len` bytes when over `max`.
pub fn check_size(len: usize, max: usize) -> Result<(), ErrorBody> {
    if len > max {
        return Err(ErrorBody::new(
            ErrorCode::TooLarge,
            format!("payload is {len} bytes; the limit is {max}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_only_what_is_over_the_limit() {
        assert!(check_size(10, 10).is_ok());
        let err = check_size(11, 10).unwrap_err();
        assert_eq!(err.code, ErrorCode::TooLarge);
        assert!(err.message.contains("11 bytes"));
    }
}
