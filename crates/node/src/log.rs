//! Structured logs: one JSON object per line on stderr, with the request id when there is one.
//!
//! Nothing a sandbox does writes a log line by itself: lines come from lifecycle changes and
//! API errors, which API rate limits and quotas bound.

use std::io::Write as _;

tokio::task_local! {
    /// The id of the request being served (set by the API's request-id middleware).
    pub static REQUEST_ID: String;
}

/// The current request's id, or `-` outside a request.
pub fn request_id() -> String {
    REQUEST_ID
        .try_with(Clone::clone)
        .unwrap_or_else(|_| "-".into())
}

fn emit(level: &str, msg: &str, fields: &[(&str, &str)]) {
    let mut obj = serde_json::Map::new();
    obj.insert(
        "ts_ms".into(),
        serde_json::Value::from(crate::clock::now_ms()),
    );
    obj.insert("level".into(), level.into());
    obj.insert("msg".into(), msg.into());
    let rid = request_id();
    if rid != "-" {
        obj.insert("request_id".into(), rid.into());
    }
    for (k, v) in fields {
        obj.insert((*k).to_owned(), (*v).into());
    }
    let line = serde_json::Value::Object(obj).to_string();
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// An informational line.
pub fn info(msg: &str, fields: &[(&str, &str)]) {
    emit("info", msg, fields);
}

/// A warning.
pub fn warn(msg: &str, fields: &[(&str, &str)]) {
    emit("warn", msg, fields);
}
