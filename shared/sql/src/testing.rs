//! A throwaway PostgreSQL database per test (feature `testing`).
//!
//! The server is `CYRENE_TEST_POSTGRES_URL` (a URL naming a maintenance database), by default
//! `postgres://postgres@127.0.0.1:5432/test`. Each [`TestDatabase`] creates `<prefix>_<uuid>` and
//! drops it (`WITH (FORCE)`) when dropped — also after a panic — so runs leave nothing behind.

use sqlx::{Connection, Executor, PgConnection};
use std::net::SocketAddr;
use std::time::Duration;

/// The maintenance database tests connect to in order to create their own.
pub fn admin_url() -> String {
    std::env::var("CYRENE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A freshly created PostgreSQL database, dropped on `Drop`.
#[derive(Debug)]
pub struct TestDatabase {
    /// The database name, `<prefix>_<uuid>`.
    pub name: String,
    /// `postgres://…/<name>`.
    pub url: String,
    admin_url: String,
}

impl TestDatabase {
    /// Creates a fresh database named `<prefix>_<uuid>`; `Err` when PostgreSQL cannot be reached
    /// within 5 s. `prefix` is lower-case letters, digits and `_`.
    pub async fn try_create(prefix: &str) -> Result<TestDatabase, String> {
        if prefix.is_empty()
            || !prefix
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(format!("prefix {prefix:?} must be [a-z0-9_]+"));
        }
        let admin_url = admin_url();
        let mut admin =
            tokio::time::timeout(Duration::from_secs(5), PgConnection::connect(&admin_url))
                .await
                .map_err(|_| format!("no answer from {admin_url} within 5s"))?
                .map_err(|e| format!("{admin_url}: {e}"))?;
        let name = format!("{prefix}_{}", uuid::Uuid::now_v7().simple());
        // `name` is our prefix (checked above) and a UUID: no input reaches the statement.
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .map_err(|e| format!("CREATE DATABASE {name}: {e}"))?;
        let _ = admin.close().await;
        let base = admin_url.split('?').next().unwrap_or_default();
        let server = base
            .rsplit_once('/')
            .map_or(base, |(server, _database)| server);
        Ok(TestDatabase {
            url: format!("{server}/{name}"),
            name,
            admin_url,
        })
    }

    /// Creates a fresh database or panics (the SQL tests require PostgreSQL; `make test` starts
    /// one when none answers).
    pub async fn create(prefix: &str) -> TestDatabase {
        match Self::try_create(prefix).await {
            Ok(db) => db,
            Err(err) => panic!("PostgreSQL is required for this test: {err}"),
        }
    }

    /// Drops the database now, terminating its connections (a database that disappears under
    /// a running service, in an outage test).
    pub async fn drop_now(&self) {
        if let Ok(mut admin) = PgConnection::connect(&self.admin_url).await {
            let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
            let _ = admin.execute(sqlx::AssertSqlSafe(sql)).await;
            let _ = admin.close().await;
        }
    }

    /// Whether this server has lz4 column compression (a build option), and the method each
    /// `(table, column)` of this database asks for: `"l"` lz4, `"p"` pglz, `""` the server's
    /// default.
    pub async fn column_compression(&self, columns: &[(&str, &str)]) -> (bool, Vec<String>) {
        let mut conn = PgConnection::connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", self.url));
        let has_lz4 = conn
            .execute("CREATE TEMP TABLE lz4_probe (v TEXT COMPRESSION lz4)")
            .await
            .is_ok();
        let mut methods = Vec::new();
        for (table, column) in columns {
            let method: String = sqlx::query_scalar(
                "SELECT a.attcompression::text FROM pg_attribute a \
                 JOIN pg_class c ON c.oid = a.attrelid WHERE c.relname = $1 AND a.attname = $2",
            )
            .bind(table)
            .bind(column)
            .fetch_one(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{table}.{column}: {e}"));
            methods.push(method);
        }
        let _ = conn.close().await;
        (has_lz4, methods)
    }

    /// The same database reached through `addr` (a proxy in an outage test).
    pub fn url_via(&self, addr: SocketAddr) -> String {
        format!("postgres://postgres@{addr}/{}", self.name)
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        // Drop may run inside a Tokio runtime: the async cleanup gets a thread of its own.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let connect = PgConnection::connect(&admin_url);
                if let Ok(Ok(mut admin)) =
                    tokio::time::timeout(Duration::from_secs(5), connect).await
                {
                    let _ = admin.execute(sqlx::AssertSqlSafe(sql)).await;
                    let _ = admin.close().await;
                }
            });
        })
        .join();
    }
}
