//! Bearer-token authentication and per-token rate limiting, as middleware in front of the
//! API. The caller it finds is put into the request's extensions for the handlers.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::db::{hash_token, Caller};
use crate::error::ApiError;
use crate::AppState;

/// How long a verified token is trusted without asking the database again. Revocation does
/// not wait for this: revoked tokens are dropped from the cache at once by the server that
/// revokes them and within `ServerConfig::revocation_poll` by every other one.
const CACHE_TTL: Duration = Duration::from_secs(30);

/// Requests per second and burst per token; `per_sec <= 0` turns limiting off.
#[derive(Clone, Copy, Debug)]
pub struct RateLimit {
    pub per_sec: f64,
    pub burst: f64,
}

impl Default for RateLimit {
    fn default() -> Self {
        RateLimit {
            per_sec: 20.0,
            burst: 40.0,
        }
    }
}

struct Bucket {
    tokens: f64,
    last: Instant,
}

/// Token buckets, one per API token.
pub struct Limiter {
    limit: RateLimit,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl Limiter {
    pub fn new(limit: RateLimit) -> Self {
        Limiter {
            limit,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one request from the token's bucket, or says how long to wait.
    pub fn check(&self, key: &str) -> Result<(), Duration> {
        if self.limit.per_sec <= 0.0 {
            return Ok(());
        }
        let mut map = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let b = map.entry(key.to_string()).or_insert(Bucket {
            tokens: self.limit.burst,
            last: now,
        });
        let refill = now.duration_since(b.last).as_secs_f64() * self.limit.per_sec;
        b.tokens = (b.tokens + refill).min(self.limit.burst.max(1.0));
        b.last = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (1.0 - b.tokens) / self.limit.per_sec,
            ))
        }
    }
}

/// Verified token hashes, so each request does not cost a database read.
#[derive(Default)]
pub struct AuthCache {
    map: Mutex<HashMap<String, (Caller, Instant)>>,
}

impl AuthCache {
    fn get(&self, hash: &str) -> Option<Caller> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(hash)
            .filter(|(_, at)| at.elapsed() < CACHE_TTL)
            .map(|(c, _)| c.clone())
    }

    fn put(&self, hash: String, caller: Caller) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.insert(hash, (caller, Instant::now()));
    }

    /// Drops the entries of these token ids; returns how many there were.
    pub fn forget(&self, token_ids: &[String]) -> usize {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let before = map.len();
        map.retain(|_, (c, _)| !token_ids.contains(&c.token_id));
        before - map.len()
    }
}

fn bearer(req: &Request) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
        .filter(|t| !t.is_empty())
}

/// Finds the caller behind the bearer token.
pub async fn authenticate(state: &AppState, token: &str) -> Result<Caller, ApiError> {
    let hash = hash_token(token);
    if let Some(c) = state.auth_cache.get(&hash) {
        return Ok(c);
    }
    let caller = state
        .db
        .caller_for_hash(hash.clone())
        .await?
        .ok_or(ApiError::Unauthorized)?;
    state.auth_cache.put(hash, caller.clone());
    Ok(caller)
}

/// Middleware: 401 without a valid token, 429 over the token's rate.
pub async fn require_token(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Response {
    let Some(token) = bearer(&req) else {
        return ApiError::Unauthorized.into_response();
    };
    let caller = match authenticate(&state, token).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    if let Err(wait) = state.limiter.check(&caller.token_id) {
        state.metrics.error("rate_limited");
        return ApiError::RateLimited {
            retry_after_secs: wait.as_secs().max(1),
        }
        .into_response();
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_allows_burst_then_refuses() {
        let l = Limiter::new(RateLimit {
            per_sec: 1.0,
            burst: 3.0,
        });
        for _ in 0..3 {
            assert!(l.check("a").is_ok());
        }
        let wait = l.check("a").expect_err("fourth request must wait");
        assert!(wait > Duration::from_millis(500), "{wait:?}");
        // Another token has its own bucket.
        assert!(l.check("b").is_ok());
    }
}
