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
    /// Steady requests per second a token may make.
    pub per_sec: f64,
    /// Requests a token may make at once above that rate.
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

/// Most buckets kept; past it the least recently used goes (which only lets its token
/// burst again).
const MAX_BUCKETS: usize = 100_000;

/// Token buckets, one per API token. A bucket idle for its window (the time to refill from
/// empty) is full, the same as a new one, so it is dropped: on [`Limiter::prune`] and when
/// the map has grown since the last pruning.
pub struct Limiter {
    limit: RateLimit,
    max_buckets: usize,
    buckets: Mutex<Buckets>,
}

struct Buckets {
    map: HashMap<String, Bucket>,
    /// Size at which an insert prunes first.
    prune_at: usize,
}

impl Limiter {
    pub fn new(limit: RateLimit) -> Self {
        Self::with_max_buckets(limit, MAX_BUCKETS)
    }

    fn with_max_buckets(limit: RateLimit, max_buckets: usize) -> Self {
        Limiter {
            limit,
            max_buckets: max_buckets.max(1),
            buckets: Mutex::new(Buckets {
                map: HashMap::new(),
                prune_at: 1024.min(max_buckets.max(1)),
            }),
        }
    }

    /// How long a bucket takes to refill from empty.
    fn window(&self) -> Duration {
        Duration::from_secs_f64((self.limit.burst.max(1.0) / self.limit.per_sec).min(1e9))
    }

    /// Drops the buckets idle for their window; returns how many it dropped.
    pub fn prune(&self) -> usize {
        let mut b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        self.prune_locked(&mut b, Instant::now())
    }

    fn prune_locked(&self, b: &mut Buckets, now: Instant) -> usize {
        if self.limit.per_sec <= 0.0 {
            let n = b.map.len();
            b.map.clear();
            return n;
        }
        let window = self.window();
        let before = b.map.len();
        b.map.retain(|_, v| now.duration_since(v.last) < window);
        // Busy tokens past the cap: the least recently used go.
        while b.map.len() >= self.max_buckets {
            let oldest = b
                .map
                .iter()
                .min_by_key(|(_, v)| v.last)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => b.map.remove(&k),
                None => break,
            };
        }
        b.prune_at = (b.map.len() * 2).clamp(1024.min(self.max_buckets), self.max_buckets);
        before - b.map.len()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.buckets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .len()
    }

    /// Takes one request from the token's bucket, or says how long to wait.
    pub fn check(&self, key: &str) -> Result<(), Duration> {
        if self.limit.per_sec <= 0.0 {
            return Ok(());
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if !buckets.map.contains_key(key) && buckets.map.len() >= buckets.prune_at {
            self.prune_locked(&mut buckets, now);
        }
        let b = buckets.map.entry(key.to_string()).or_insert(Bucket {
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

    #[test]
    fn idle_buckets_are_pruned_and_the_map_is_bounded() {
        // Window: 2 / 100 per second = 20 ms.
        let l = Limiter::new(RateLimit {
            per_sec: 100.0,
            burst: 2.0,
        });
        for i in 0..50 {
            l.check(&format!("tok_{i}")).unwrap();
        }
        assert_eq!(l.len(), 50);
        assert_eq!(l.prune(), 0, "nothing is idle yet");
        std::thread::sleep(Duration::from_millis(40));
        l.check("tok_busy").unwrap();
        assert_eq!(l.prune(), 50);
        assert_eq!(l.len(), 1);

        // A slow refill (nothing goes idle) and many tokens: the cap holds, on insert.
        let l = Limiter::with_max_buckets(
            RateLimit {
                per_sec: 0.001,
                burst: 5.0,
            },
            16,
        );
        for i in 0..1000 {
            l.check(&format!("tok_{i}")).unwrap();
            assert!(l.len() <= 16, "{} buckets", l.len());
        }
        // The newest token kept its bucket: its second request takes from it.
        l.check("tok_999").unwrap();
        assert!(l.len() <= 16);
    }
}
