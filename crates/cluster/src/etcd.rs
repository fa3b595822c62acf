//! A blocking client of etcd's v3 API through its JSON gateway (`POST /v3/kv/range`, …; keys and
//! values base64, 64-bit numbers as strings). Each call tries the endpoints in turn, starting
//! with the one that answered last, and gives up after [`CALL_TIMEOUT`] per endpoint.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};

/// How long one call to one endpoint may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// What went wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint answered.
    #[error("etcd unavailable ({endpoints}): {last}")]
    Unavailable {
        /// The endpoints tried.
        endpoints: String,
        /// The last transport error.
        last: String,
    },
    /// An endpoint answered with an error.
    #[error("etcd {path}: {status} {body}")]
    Status {
        /// The API path.
        path: String,
        /// HTTP status.
        status: u16,
        /// The answer.
        body: String,
    },
    /// An answer that is not what the API documents.
    #[error("etcd {path}: unexpected answer {body}")]
    Parse {
        /// The API path.
        path: String,
        /// The answer.
        body: String,
    },
}

/// One key-value pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// The key.
    pub key: String,
    /// The value.
    pub value: Vec<u8>,
    /// The revision that created the key.
    pub create_revision: i64,
    /// The revision that last changed it.
    pub mod_revision: i64,
    /// Its lease (0: none).
    pub lease: i64,
}

/// A client of one etcd cluster.
#[derive(Debug)]
pub struct Etcd {
    endpoints: Vec<String>,
    agent: ureq::Agent,
    current: AtomicUsize,
}

fn b64(s: &[u8]) -> String {
    B64.encode(s)
}

fn num(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The key just past every key with `prefix` (etcd's `range_end` for a prefix).
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn parse_kv(v: &Value) -> Option<Kv> {
    let key = B64.decode(v["key"].as_str()?).ok()?;
    let value = match v["value"].as_str() {
        Some(s) => B64.decode(s).ok()?,
        None => Vec::new(),
    };
    Some(Kv {
        key: String::from_utf8(key).ok()?,
        value,
        create_revision: num(&v["create_revision"]),
        mod_revision: num(&v["mod_revision"]),
        lease: num(&v["lease"]),
    })
}

impl Etcd {
    /// A client of the comma-separated `endpoints` (`http://host:port,...`).
    pub fn new(endpoints: &str) -> Self {
        Self {
            endpoints: endpoints
                .split(',')
                .map(|e| e.trim().trim_end_matches('/').to_owned())
                .filter(|e| !e.is_empty())
                .collect(),
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(CALL_TIMEOUT))
                .build()
                .into(),
            current: AtomicUsize::new(0),
        }
    }

    /// The endpoints, as given.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// `POST {endpoint}{path}` with `body`, on each endpoint in turn until one answers.
    fn post(&self, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let n = self.endpoints.len().max(1);
        let start = self.current.load(Ordering::Relaxed);
        let mut last = String::from("no endpoint");
        for i in 0..n {
            let at = (start + i) % n;
            let Some(ep) = self.endpoints.get(at) else {
                break;
            };
            match self.agent.post(format!("{ep}{path}")).send_json(body) {
                Ok(mut r) => {
                    let status = r.status().as_u16();
                    let text = r.body_mut().read_to_string().unwrap_or_default();
                    // A member without quorum answers 503 or times out: try the next one.
                    if status == 503 || status == 500 && text.contains("no leader") {
                        last = format!("{ep}: {status} {text}");
                        continue;
                    }
                    self.current.store(at, Ordering::Relaxed);
                    if status != 200 {
                        return Err(EtcdError::Status {
                            path: path.into(),
                            status,
                            body: text,
                        });
                    }
                    return serde_json::from_str(&text).map_err(|_| EtcdError::Parse {
                        path: path.into(),
                        body: text,
                    });
                }
                Err(e) => last = format!("{ep}: {e}"),
            }
        }
        Err(EtcdError::Unavailable {
            endpoints: self.endpoints.join(","),
            last,
        })
    }

    /// Puts `key` = `value`, attached to `lease` when non-zero. Answers the new revision.
    pub fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<i64, EtcdError> {
        let mut body = json!({"key": b64(key.as_bytes()), "value": b64(value)});
        if lease != 0 {
            body["lease"] = lease.to_string().into();
        }
        let v = self.post("/v3/kv/put", &body)?;
        Ok(num(&v["header"]["revision"]))
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Result<Option<Kv>, EtcdError> {
        let v = self.post("/v3/kv/range", &json!({"key": b64(key.as_bytes())}))?;
        Ok(v["kvs"]
            .as_array()
            .and_then(|a| a.first())
            .and_then(parse_kv))
    }

    /// Every key with `prefix`, sorted, and the store's revision at the read.
    pub fn prefix(&self, prefix: &str) -> Result<(Vec<Kv>, i64), EtcdError> {
        let v = self.post(
            "/v3/kv/range",
            &json!({"key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix))}),
        )?;
        let kvs = v["kvs"]
            .as_array()
            .map(|a| a.iter().filter_map(parse_kv).collect())
            .unwrap_or_default();
        Ok((kvs, num(&v["header"]["revision"])))
    }

    /// What changes whenever a key with `prefix` is added, changed or deleted: how many there
    /// are and the newest one's mod revision. One small read, whatever the prefix holds: a
    /// poller rereads the prefix only when this changed.
    pub fn prefix_version(&self, prefix: &str) -> Result<(i64, i64), EtcdError> {
        let v = self.post(
            "/v3/kv/range",
            &json!({"key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix)),
                    "limit": 1, "sort_order": "DESCEND", "sort_target": "MOD", "keys_only": true}),
        )?;
        let newest = v["kvs"]
            .as_array()
            .and_then(|a| a.first())
            .map_or(0, |kv| num(&kv["mod_revision"]));
        Ok((num(&v["count"]), newest))
    }

    /// Deletes `key`; answers whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool, EtcdError> {
        let v = self.post("/v3/kv/deleterange", &json!({"key": b64(key.as_bytes())}))?;
        Ok(num(&v["deleted"]) > 0)
    }

    /// Puts `key` = `value` only if `key` does not exist (a transaction on its create
    /// revision). Answers whether it was created.
    pub fn create(&self, key: &str, value: &[u8], lease: i64) -> Result<bool, EtcdError> {
        self.put_if(key, value, lease, "CREATE", 0)
    }

    /// Puts `key` = `value` only if its mod revision is still `mod_revision` (0: it must not
    /// exist). Answers whether it was written.
    pub fn compare_and_put(
        &self,
        key: &str,
        value: &[u8],
        mod_revision: i64,
    ) -> Result<bool, EtcdError> {
        self.put_if(key, value, 0, "MOD", mod_revision)
    }

    fn put_if(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
        target: &str,
        revision: i64,
    ) -> Result<bool, EtcdError> {
        let k = b64(key.as_bytes());
        let field = if target == "CREATE" {
            "create_revision"
        } else {
            "mod_revision"
        };
        let mut put = json!({"key": k, "value": b64(value)});
        if lease != 0 {
            put["lease"] = lease.to_string().into();
        }
        let body = json!({
            "compare": [{"key": k, "result": "EQUAL", "target": target, field: revision.to_string()}],
            "success": [{"request_put": put}],
        });
        let v = self.post("/v3/kv/txn", &body)?;
        Ok(v["succeeded"].as_bool().unwrap_or(false))
    }

    /// Grants a lease of `ttl` seconds; answers its id.
    pub fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        let v = self.post("/v3/lease/grant", &json!({"TTL": ttl.to_string()}))?;
        match num(&v["ID"]) {
            0 => Err(EtcdError::Parse {
                path: "/v3/lease/grant".into(),
                body: v.to_string(),
            }),
            id => Ok(id),
        }
    }

    /// Renews lease `id`; answers its TTL, 0 once it has expired.
    pub fn keep_alive(&self, id: i64) -> Result<i64, EtcdError> {
        let v = self.post("/v3/lease/keepalive", &json!({"ID": id.to_string()}))?;
        Ok(num(&v["result"]["TTL"]))
    }

    /// Revokes lease `id` (its keys go with it).
    pub fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.post("/v3/lease/revoke", &json!({"ID": id.to_string()}))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(prefix_end("/dsec/nodes/"), b"/dsec/nodes0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }

    #[test]
    fn kvs_parse_from_the_json_gateway() {
        let v = json!({"key": "Zm9v", "create_revision": "2", "mod_revision": "5",
                       "version": "1", "value": "YmFy", "lease": "7"});
        let kv = parse_kv(&v).expect("kv");
        assert_eq!((kv.key.as_str(), kv.value.as_slice()), ("foo", &b"bar"[..]));
        assert_eq!((kv.create_revision, kv.mod_revision, kv.lease), (2, 5, 7));
        assert!(parse_kv(&json!({"key": "!!"})).is_none());
    }
}
