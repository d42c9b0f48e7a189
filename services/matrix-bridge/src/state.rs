//! What the bridge remembers across restarts, in one JSON file in its data directory
//! (`matrix-bridge.json`, mode 0600: it holds the bot's access token).
//!
//! # Invariants
//! - The file is replaced whole: written beside it, synced, then renamed over it — a crash
//!   leaves the old state or the new one, never half of either.
//! - `since` (the sync token) is saved only after every message of the sync batch before it was
//!   acknowledged by the orchestrator, so a restart re-reads what was not: each message is sent
//!   at least once, and its Matrix event id (the idempotency key) makes it stored once.
//! - `posted_seq` of a session is raised only after the answers up to it were posted; a crash
//!   in between posts them again with the same transaction ids, which the homeserver drops.
//! - A call enters `asked` only after its approval notice was posted (the same rule).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The state file's name inside the data directory.
pub const STATE_FILE: &str = "matrix-bridge.json";

/// Everything kept across restarts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// The bot's access token from its password login: reused, so the homeserver keeps
    /// recognising the transaction ids of this device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_token: Option<String>,
    /// The token of the next `/sync`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// The sessions the bridge has sent to, by session id.
    #[serde(default)]
    pub sessions: BTreeMap<String, SessionState>,
}

/// One session of a room.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionState {
    /// The room its answers go to.
    pub room_id: String,
    /// The seq of the last transcript entry whose answer was posted (0: none yet).
    #[serde(default)]
    pub posted_seq: u64,
    /// The calls waiting for a decision whose notice was posted: not posted again after a
    /// restart; forgotten once decided.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub asked: BTreeSet<String>,
}

/// Why the state could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a state file of the bridge: {source}")]
    Corrupt {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl State {
    /// The state in `dir` (empty when there is none yet; the directory is created).
    pub fn load(dir: &Path) -> Result<State, StateError> {
        let path = dir.join(STATE_FILE);
        std::fs::create_dir_all(dir).map_err(|source| StateError::Write {
            path: dir.to_owned(),
            source,
        })?;
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|source| StateError::Corrupt { path, source }),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(State::default()),
            Err(source) => Err(StateError::Read { path, source }),
        }
    }

    /// Replaces the state file in `dir` with this state (module docs).
    pub fn save(&self, dir: &Path) -> Result<(), StateError> {
        let path = dir.join(STATE_FILE);
        let temp = dir.join(format!("{STATE_FILE}.tmp"));
        let write = |source| StateError::Write {
            path: path.clone(),
            source,
        };
        let bytes = serde_json::to_vec_pretty(self).unwrap_or_default();
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&temp).map_err(write)?;
        file.write_all(&bytes).map_err(write)?;
        file.sync_all().map_err(write)?;
        drop(file);
        std::fs::rename(&temp, &path).map_err(write)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_survives_a_restart_and_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(State::load(dir.path()).unwrap(), State::default());
        let mut state = State {
            access_token: Some("syt_x".into()),
            since: Some("s42".into()),
            ..State::default()
        };
        state.sessions.insert(
            "alice.mx-1".into(),
            SessionState {
                room_id: "!r:l".into(),
                posted_seq: 7,
                asked: ["c1".to_owned()].into(),
            },
        );
        state.save(dir.path()).unwrap();
        assert_eq!(State::load(dir.path()).unwrap(), state);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(STATE_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "only the bridge reads its token");
        }
        std::fs::write(dir.path().join(STATE_FILE), b"{not json").unwrap();
        assert!(matches!(
            State::load(dir.path()),
            Err(StateError::Corrupt { .. })
        ));
    }
}
