//! [`WarmPool`]: sqlx's pool with the check on release taken off a finished use's way.
//!
//! sqlx checks every connection as it goes back to its pool: a task is spawned, and the
//! connection pinged (on PostgreSQL a round trip to the server; on SQLite a hop to the
//! connection's thread) before anyone may take it again. That check is there for a use that did
//! not finish — a query whose future was dropped mid-way, a transaction dropped without its
//! `COMMIT` — so the connection is flushed (a pending `ROLLBACK` sent) or closed before the
//! next user. A use that finished leaves nothing to flush, and the ping only costs: about ten
//! round trips a turn that no statement log shows (docs/performance.md, "sqlx's check on
//! release").
//!
//! # Invariants
//! - A connection whose use **finished** (a statement run to its answer, or a transaction
//!   committed or rolled back) goes onto a stack of warm connections, unchecked. The last one
//!   back is the first handed out again: under light load one connection does the work (and,
//!   on SQLite, keeps its page cache).
//! - Every other connection — its use cancelled, a statement that failed (even a refusal by the
//!   server), a transaction dropped open (its `ROLLBACK` queued) — goes back to sqlx as before,
//!   which flushes and checks it or closes it. Nothing unfinished is ever handed out.
//! - A warm connection is handed out unchecked only within [`RECENTLY_CHECKED`] of its last
//!   finished use, the pool's rule for an idle connection ([`crate::PoolSettings::options`]);
//!   older ones go back to sqlx, which checks them. A database lost in that moment fails one
//!   request with an I/O error (`unavailable`, retryable), as a loss during the query would.
//! - Warm connections count against the pool's size. A caller that finds none waits for a warm
//!   one and for sqlx's pool at once, the pool's acquire timeout bounding the whole wait; sqlx's
//!   acquire is never cancelled (what it brings after a warm one came first goes on the stack),
//!   so no connection is opened and closed for nothing.
//!
//! # Pitfalls
//! - A warm connection is out of sqlx's sight, so its idle timeout does not close it: after a
//!   burst the stack keeps up to the pool's size of connections open until the next caller,
//!   which hands the stale ones to sqlx (whose idle timeout then applies). A service that gets
//!   no request at all after a burst keeps them open.

use crate::RECENTLY_CHECKED;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use sqlx::pool::PoolConnection;
use sqlx::{Database, Either, Execute, Executor, Pool, SqlStr};
use sqlx_core::transaction::TransactionManager;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

/// A sqlx [`Pool`] whose connections, put back after a finished use, are handed out again
/// without sqlx's check on release (module doc). Cheap to clone: clones share one pool.
pub struct WarmPool<DB: Database> {
    inner: Arc<Inner<DB>>,
}

struct Inner<DB: Database> {
    pool: Pool<DB>,
    /// Finished connections and when they were put back, newest last.
    warm: Mutex<Vec<(PoolConnection<DB>, Instant)>>,
    /// Told when a connection is put back warm.
    freed: Notify,
}

impl<DB: Database> Clone for WarmPool<DB> {
    fn clone(&self) -> Self {
        WarmPool {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<DB: Database> fmt::Debug for WarmPool<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WarmPool")
            .field("pool", &self.inner.pool)
            .finish_non_exhaustive()
    }
}

impl<DB: Database> WarmPool<DB> {
    pub fn new(pool: Pool<DB>) -> Self {
        WarmPool {
            inner: Arc::new(Inner {
                pool,
                warm: Mutex::new(Vec::new()),
                freed: Notify::new(),
            }),
        }
    }

    /// A connection: the newest warm one, else one from sqlx's pool, whichever comes first
    /// within the pool's acquire timeout. Mark it [`Warm::finished`] after its last use.
    pub async fn acquire(&self) -> Result<Warm<DB>, sqlx::Error> {
        let conn = match self.take_warm() {
            Some(conn) => conn,
            None => {
                let timeout = self.inner.pool.options().get_acquire_timeout();
                tokio::time::timeout(timeout, self.wait())
                    .await
                    .map_err(|_| sqlx::Error::PoolTimedOut)??
            }
        };
        Ok(Warm {
            conn: Some(conn),
            finished: false,
            pool: Arc::clone(&self.inner),
        })
    }

    /// Waits for a connection put back warm or one from sqlx's pool. sqlx's acquire runs in a
    /// task of its own and is never cancelled: cancelled while it opens a connection, it would
    /// close it again (under load, every time a warm one came back first, a PostgreSQL backend
    /// started and ended for nothing). What it gets after a warm one came first goes on the
    /// stack for the next caller.
    async fn wait(&self) -> Result<PoolConnection<DB>, sqlx::Error> {
        let (tx, mut from_pool) = tokio::sync::oneshot::channel();
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            match inner.pool.acquire().await {
                Ok(conn) => {
                    if let Err(Ok(conn)) = tx.send(Ok(conn)) {
                        put_back(&inner, conn);
                    }
                }
                Err(err) => {
                    let _ = tx.send(Err(err));
                }
            }
        });
        loop {
            // Registered before looking, so a connection put back after the look wakes us.
            let freed = self.inner.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(conn) = self.take_warm() {
                return Ok(conn);
            }
            tokio::select! {
                biased;
                () = &mut freed => {}
                conn = &mut from_pool => {
                    return conn.unwrap_or(Err(sqlx::Error::PoolClosed));
                }
            }
        }
    }

    /// A transaction: `BEGIN`, or `statement` in its place (SQLite's `BEGIN IMMEDIATE`).
    pub async fn begin_with(&self, statement: Option<SqlStr>) -> Result<WarmTx<DB>, sqlx::Error> {
        let mut conn = self.acquire().await?;
        DB::TransactionManager::begin(&mut conn, statement).await?;
        Ok(WarmTx { conn, open: true })
    }

    /// A transaction opened with `BEGIN`.
    pub async fn begin(&self) -> Result<WarmTx<DB>, sqlx::Error> {
        self.begin_with(None).await
    }

    /// Closes the pool and hands the warm connections back to sqlx, which closes them.
    pub async fn close(&self) {
        // Marked closed first: a connection finished after the stack is emptied sees it under
        // the stack's lock and goes to sqlx, which would otherwise wait for it forever.
        let closing = self.inner.pool.close();
        let warm = std::mem::take(&mut *self.lock());
        drop(warm);
        closing.await;
    }

    /// The newest warm connection put back within [`RECENTLY_CHECKED`]; older ones go back to
    /// sqlx (dropped outside the lock: the drop spawns sqlx's check).
    fn take_warm(&self) -> Option<PoolConnection<DB>> {
        let mut warm = self.lock();
        let (conn, at) = warm.pop()?;
        if at.elapsed() < RECENTLY_CHECKED {
            return Some(conn);
        }
        // Put back oldest first: every one below is older still.
        let stale = std::mem::take(&mut *warm);
        drop(warm);
        drop((conn, stale));
        None
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(PoolConnection<DB>, Instant)>> {
        lock(&self.inner.warm)
    }
}

/// The stack's lock, whatever a panicking holder left (a `Vec` push or pop cannot leave it
/// broken).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A connection from a [`WarmPool`]. Dropped after [`Warm::finished`] it goes back warm;
/// dropped without, back to sqlx's check.
pub struct Warm<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    finished: bool,
    pool: Arc<Inner<DB>>,
}

impl<DB: Database> fmt::Debug for Warm<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Warm")
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl<DB: Database> Warm<DB> {
    /// Says the last use ran to its answer: nothing is left to flush.
    pub fn finished(mut self) {
        self.finished = true;
    }
}

impl<DB: Database> Deref for Warm<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.conn.as_deref().unwrap_or_else(|| gone())
    }
}

impl<DB: Database> DerefMut for Warm<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.conn.as_deref_mut().unwrap_or_else(|| gone())
    }
}

/// A `Warm` holds its connection until it is dropped.
fn gone() -> ! {
    unreachable!("a Warm connection is taken only when it is dropped")
}

impl<DB: Database> Drop for Warm<DB> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if !self.finished {
            // sqlx's path: flushed and checked, or closed.
            drop(conn);
            return;
        }
        put_back(&self.pool, conn);
    }
}

/// `conn`, at rest, onto the warm stack (to sqlx once the pool is closed), and one waiter told.
fn put_back<DB: Database>(pool: &Inner<DB>, conn: PoolConnection<DB>) {
    let mut warm = lock(&pool.warm);
    if pool.pool.is_closed() {
        drop(warm);
        drop(conn);
        return;
    }
    warm.push((conn, Instant::now()));
    // The oldest, unused for a while under this load, goes back to sqlx's check.
    let stale = match warm.first() {
        Some((_, at)) if at.elapsed() >= RECENTLY_CHECKED => Some(warm.remove(0)),
        _ => None,
    };
    drop(warm);
    drop(stale);
    pool.freed.notify_one();
}

/// A transaction on a [`Warm`] connection. [`WarmTx::commit`] or [`WarmTx::rollback`] puts the
/// connection back warm; dropped open, its `ROLLBACK` is queued and the connection goes back to
/// sqlx, which sends it (as sqlx's own `Transaction` does).
pub struct WarmTx<DB: Database> {
    conn: Warm<DB>,
    open: bool,
}

impl<DB: Database> fmt::Debug for WarmTx<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WarmTx")
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}

impl<DB: Database> WarmTx<DB> {
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        DB::TransactionManager::commit(&mut self.conn).await?;
        self.close_finished();
        Ok(())
    }

    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        DB::TransactionManager::rollback(&mut self.conn).await?;
        self.close_finished();
        Ok(())
    }

    fn close_finished(&mut self) {
        self.open = false;
        self.conn.finished = true;
    }
}

impl<DB: Database> Deref for WarmTx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.conn
    }
}

impl<DB: Database> DerefMut for WarmTx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }
}

impl<DB: Database> Drop for WarmTx<DB> {
    fn drop(&mut self) {
        if self.open {
            DB::TransactionManager::start_rollback(&mut self.conn);
        }
    }
}

/// One statement on a connection of the pool, as on sqlx's `&Pool`: the connection goes back
/// warm once the statement has answered.
impl<'p, DB: Database> Executor<'p> for &'_ WarmPool<DB>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
{
    type Database = DB;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<DB::QueryResult, DB::Row>, sqlx::Error>>
    where
        E: 'q + Execute<'q, DB>,
    {
        let pool = self.clone();
        // Collected before it is yielded: the connection goes back before the caller reads.
        futures::stream::once(async move {
            let mut conn = pool.acquire().await?;
            let all: Vec<_> = conn.fetch_many(query).try_collect().await?;
            conn.finished();
            Ok::<_, sqlx::Error>(all)
        })
        .map_ok(|all| futures::stream::iter(all.into_iter().map(Ok)))
        .try_flatten()
        .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<DB::Row>, sqlx::Error>>
    where
        E: 'q + Execute<'q, DB>,
    {
        let pool = self.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let row = conn.fetch_optional(query).await?;
            conn.finished();
            Ok(row)
        })
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [DB::TypeInfo],
    ) -> BoxFuture<'e, Result<DB::Statement, sqlx::Error>>
    where
        'p: 'e,
    {
        let pool = self.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let statement = conn.prepare_with(sql, parameters).await?;
            conn.finished();
            Ok(statement)
        })
    }

    /// (sqlx's `offline` feature, which its `macros` feature turns on, adds this method.)
    fn describe<'e>(self, sql: SqlStr) -> BoxFuture<'e, Result<sqlx::Describe<DB>, sqlx::Error>> {
        let pool = self.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let described = conn.describe(sql).await?;
            conn.finished();
            Ok(described)
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::{PoolSettings, SqliteSettings};
    use sqlx::{Row, Sqlite};
    use std::time::Duration;

    /// A fresh SQLite file's pool of `size` connections with table `t (x)`.
    async fn pool(name: &str, size: u32) -> (WarmPool<Sqlite>, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("cyrene-warm-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = format!("sqlite://{}/w.db", dir.display());
        let options = SqliteSettings::CHECKPOINTS.connect_options(&url).unwrap();
        let pool = PoolSettings {
            max_connections: size,
            acquire_timeout: Duration::from_secs(2),
        }
        .options::<Sqlite>()
        .connect_with(options)
        .await
        .unwrap();
        let pool = WarmPool::new(pool);
        sqlx::query("CREATE TABLE t (x INTEGER)")
            .execute(&pool)
            .await
            .unwrap();
        (pool, dir)
    }

    fn warm(pool: &WarmPool<Sqlite>) -> usize {
        pool.lock().len()
    }

    #[tokio::test]
    async fn a_finished_statement_puts_its_connection_back_warm_and_it_is_taken_again() {
        let (pool, dir) = pool("finished", 4).await;
        assert_eq!(warm(&pool), 1, "the CREATE's connection is warm");
        for x in 0..5 {
            sqlx::query("INSERT INTO t (x) VALUES (?)")
                .bind(x)
                .execute(&pool)
                .await
                .unwrap();
        }
        // One connection did all of it, one after the other: the newest warm one is taken.
        assert_eq!(warm(&pool), 1);
        assert_eq!(pool.inner.pool.size(), 1);
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM t")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, 5);
        pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn an_unfinished_use_goes_back_through_sqlx_and_an_open_transaction_rolls_back() {
        let (pool, dir) = pool("unfinished", 4).await;
        let conn = pool.acquire().await.unwrap();
        assert_eq!(warm(&pool), 0);
        drop(conn);
        assert_eq!(warm(&pool), 0, "not marked finished: not warm");

        let mut tx = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO t (x) VALUES (1)")
            .execute(&mut *tx)
            .await
            .unwrap();
        drop(tx);
        assert_eq!(warm(&pool), 0, "dropped open: not warm");
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM t")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, 0, "the dropped transaction's row is gone");

        let mut tx = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO t (x) VALUES (2)")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let row = sqlx::query("SELECT COUNT(*) AS n FROM t")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(row.get::<i64, _>("n"), 1);
        assert!(
            warm(&pool) >= 1,
            "a committed transaction's connection is warm"
        );

        let failed = sqlx::query("SELECT * FROM no_such_table")
            .fetch_all(&pool)
            .await;
        assert!(failed.is_err());
        pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_waiting_caller_takes_a_connection_put_back_warm() {
        // One connection: a caller that waited on sqlx's pool alone while the connection sat
        // in the warm stack would time out.
        let (pool, dir) = pool("waiter", 1).await;
        let held = pool.acquire().await.unwrap();
        let waiter = tokio::spawn({
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>("SELECT 7")
                    .fetch_one(&pool)
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        held.finished();
        assert_eq!(waiter.await.unwrap().unwrap(), 7);
        pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_connection_warm_for_longer_than_the_check_interval_goes_back_to_sqlx() {
        let (pool, dir) = pool("stale", 2).await;
        assert_eq!(warm(&pool), 1);
        tokio::time::sleep(RECENTLY_CHECKED + Duration::from_millis(100)).await;
        let conn = pool.acquire().await.unwrap();
        assert_eq!(warm(&pool), 0, "the stale one was handed back, not out");
        conn.finished();
        assert_eq!(warm(&pool), 1);
        pool.close().await;
        assert_eq!(warm(&pool), 0);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn under_contention_no_connection_is_opened_for_nothing() {
        // Opening a connection takes a while here (as a PostgreSQL backend's start does); an
        // acquire cancelled mid-way, whenever a warm connection came back first, would open
        // another and another.
        let dir = std::env::temp_dir().join(format!("cyrene-warm-{}-churn", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = format!("sqlite://{}/w.db", dir.display());
        let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let pool = PoolSettings {
            max_connections: 3,
            acquire_timeout: Duration::from_secs(10),
        }
        .options::<Sqlite>()
        .after_connect({
            let opened = Arc::clone(&opened);
            move |_, _| {
                opened.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Box::pin(async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok(())
                })
            }
        })
        .connect_with(SqliteSettings::CHECKPOINTS.connect_options(&url).unwrap())
        .await
        .unwrap();
        let pool = WarmPool::new(pool);
        let calls: Vec<_> = (0..40)
            .map(|i| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    for _ in 0..5 {
                        let n: i64 = sqlx::query_scalar("SELECT ?")
                            .bind(i)
                            .fetch_one(&pool)
                            .await
                            .unwrap();
                        assert_eq!(n, i);
                    }
                })
            })
            .collect();
        for call in calls {
            call.await.unwrap();
        }
        assert!(
            opened.load(std::sync::atomic::Ordering::SeqCst) <= 3,
            "{} connections opened for a pool of 3",
            opened.load(std::sync::atomic::Ordering::SeqCst)
        );
        pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }
}
