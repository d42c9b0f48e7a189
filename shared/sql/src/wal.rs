//! The WAL of an SQLite file, copied into the file by a task of the service's own
//! ([`WalTask`]) instead of inside whichever commit crosses SQLite's automatic threshold.
//!
//! # Invariants
//! - The task checkpoints every [`WAL_CHECKPOINT_EVERY`] with `PRAGMA wal_checkpoint(PASSIVE)`
//!   on a connection of its own: it waits for no reader and no writer, and commits nothing, so
//!   it empties no other connection's page cache.
//! - A writer still checkpoints inline once the WAL holds [`WAL_AUTOCHECKPOINT_PAGES`]
//!   ([`crate::SqliteSettings`] sets that threshold on every connection of a WAL file), so a
//!   stalled task cannot let the WAL grow without bound (10,000 pages of 4 KiB: 40 MiB).
//! - Dropping the [`WalTask`] or [`WalTask::close`] stops the task; `close` also closes its
//!   connection, waiting for a checkpoint under way to end.
//!
//! Why: with SQLite's default threshold (1,000 pages), the commit that crossed it copied the
//! WAL into the file and synced it before returning, which stalled one write in a few hundred
//! by tens of milliseconds (docs/performance.md, "The SQLite WAL off the save's path").

use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often a [`WalTask`] checkpoints the WAL.
pub const WAL_CHECKPOINT_EVERY: Duration = Duration::from_millis(250);

/// The WAL size, in pages, past which a writer checkpoints inline: SQLite's default (1,000)
/// raised, so that only a [`WalTask`] fallen far behind leaves the copy to a commit.
pub const WAL_AUTOCHECKPOINT_PAGES: u32 = 10_000;

/// A task checkpointing one SQLite file's WAL, and the one connection it runs on.
#[derive(Debug)]
pub struct WalTask {
    pool: SqlitePool,
    stop: CancellationToken,
}

impl WalTask {
    /// Opens one connection with `options` (the file's, [`crate::SqliteSettings`]) and
    /// checkpoints its WAL every `every` until stopped.
    pub async fn start(
        options: SqliteConnectOptions,
        every: Duration,
    ) -> Result<WalTask, sqlx::Error> {
        let pool = sqlx::pool::PoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await?;
        let task = WalTask {
            pool,
            stop: CancellationToken::new(),
        };
        let (pool, stop) = (task.pool.clone(), task.stop.clone());
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                match sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
                    .execute(&pool)
                    .await
                {
                    Ok(_) => {}
                    Err(sqlx::Error::PoolClosed) => return,
                    // The next tick tries again; the writers' own threshold bounds the WAL
                    // meanwhile.
                    Err(error) => tracing::warn!(%error, "WAL checkpoint failed"),
                }
            }
        });
        Ok(task)
    }

    /// The task's own connection (tests run a checkpoint on it).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Whether the task was told to stop.
    pub fn is_stopped(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Stops the task and closes its connection (waiting for a checkpoint under way to end).
    pub async fn close(&self) {
        self.stop.cancel();
        self.pool.close().await;
    }
}

impl Drop for WalTask {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SqliteSettings;

    /// Writes on another connection reach the database file through the task (a commit only
    /// appends to the WAL, and the writers' threshold is far away); closing stops the task.
    #[tokio::test]
    async fn the_task_copies_the_wal_into_the_file() {
        let dir = std::env::temp_dir().join(format!("cyrene-wal-{}", std::process::id()));
        let file = dir.join("w.db");
        let url = format!("sqlite://{}", file.display());
        let options = SqliteSettings::SESSIONS.connect_options(&url).unwrap();
        let writer: SqlitePool = sqlx::pool::PoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .unwrap();
        let threshold: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
            .fetch_one(&writer)
            .await
            .unwrap();
        assert_eq!(threshold, i64::from(WAL_AUTOCHECKPOINT_PAGES));
        sqlx::query("CREATE TABLE t (v TEXT)")
            .execute(&writer)
            .await
            .unwrap();
        let task = WalTask::start(options, Duration::from_millis(20))
            .await
            .unwrap();
        let size = || std::fs::metadata(&file).unwrap().len();
        let before = size();
        for _ in 0..50 {
            sqlx::query("INSERT INTO t VALUES (?1)")
                .bind("x".repeat(4000))
                .execute(&writer)
                .await
                .unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while size() <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "the WAL never reached the file"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        task.close().await;
        assert!(task.pool().is_closed());
        assert!(task.is_stopped());
        writer.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }
}
