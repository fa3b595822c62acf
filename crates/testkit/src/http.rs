//! A small blocking HTTP client of the daemon: one keep-alive connection pool, an API key, and
//! answers as status + JSON.

use std::time::Duration;

use serde_json::Value;
use ureq::http::HeaderMap;

/// Largest answer read (a listing of 1,000 sandboxes fits).
const MAX_BODY: u64 = 64 << 20;

/// A client of one daemon's URL with one API key (or none).
#[derive(Clone)]
pub struct Http {
    agent: ureq::Agent,
    url: String,
    key: Option<String>,
}

/// One answer.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body.
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON, `Null` when it is not JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

impl Http {
    /// A client of `url` (`http://host:port`) sending `key` as `X-API-Key` when given; every
    /// call gives up after `timeout` when given. Statuses of 400 and above are answers, not
    /// errors.
    pub fn new(url: &str, key: Option<&str>, timeout: Option<Duration>) -> Self {
        Self {
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .max_idle_connections(256)
                .max_idle_connections_per_host(256)
                .timeout_global(timeout)
                .build()
                .into(),
            url: url.to_owned(),
            key: key.map(str::to_owned),
        }
    }

    /// The same client (and connection pool) with another key, or none.
    pub fn with_key(&self, key: Option<&str>) -> Self {
        Self {
            key: key.map(str::to_owned),
            ..self.clone()
        }
    }

    /// `METHOD PATH` with `body` (sent for every method given one; POST, PUT and PATCH send an
    /// empty one without) and extra `headers`.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        headers: &[(&str, &str)],
    ) -> Result<Reply, ureq::Error> {
        let url = format!("{}{path}", self.url);
        let mut req = ureq::http::Request::builder().method(method).uri(&url);
        if let Some(k) = &self.key {
            req = req.header("X-API-Key", k);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let has_body = body.is_some() || matches!(method, "POST" | "PUT" | "PATCH");
        let r = if has_body {
            let req = req.body(body.unwrap_or_default().to_vec())?;
            self.agent.run(req)
        } else {
            let req = req.body(())?;
            self.agent.run(req)
        };
        let mut r = r?;
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r.body_mut().with_config().limit(MAX_BODY).read_to_vec()?;
        Ok(Reply {
            status,
            headers,
            body,
        })
    }

    /// `METHOD PATH [BODY]`: status and JSON answer (`Null` when it is not JSON).
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), ureq::Error> {
        let body = body.map(|b| b.to_string().into_bytes());
        let r = self.send(method, path, body.as_deref(), &[])?;
        Ok((r.status, r.json()))
    }

    /// [`Http::call`], with status 0 and `{"transport_error": ...}` when no answer came.
    pub fn req(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        self.call(method, path, body)
            .unwrap_or_else(|e| (0, crate::transport_error(&e)))
    }

    /// A GET of `path` whose answer is read as it comes (an event stream).
    pub fn get_streaming(
        &self,
        path: &str,
    ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        let mut req = self.agent.get(format!("{}{path}", self.url));
        if let Some(k) = &self.key {
            req = req.header("X-API-Key", k);
        }
        req.call()
    }

    /// A GET of `path` without key, its body as text (empty on failure): `/metrics`.
    pub fn text(&self, path: &str) -> String {
        self.with_key(None)
            .send("GET", path, None, &[])
            .map(|r| String::from_utf8_lossy(&r.body).into_owned())
            .unwrap_or_default()
    }
}
