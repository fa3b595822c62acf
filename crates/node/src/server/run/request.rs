//! A run request: parsed field by field from the JSON body, so that a bad field is named (in
//! the native API's problem and in the `{"detail": [...]}` of SandboxFusion's routes, which
//! has FastAPI's shape), and validated into a [`RunSpec`].
//!
//! SandboxFusion ignores fields it does not know (datasets carry extra keys): so do its routes
//! here. The native `/v1/run` refuses them.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use dsec_api::ErrorCode;
use serde_json::{json, Map, Value};

use super::lang::{self, Lang, Program};
use super::{Substrate, B64, FUNCTION_OUTPUT_MAX, MAX_CODE, MAX_FILES, MAX_FILES_BYTES};
use crate::server::error::ApiError;

/// Longest run or compile phase, seconds: longer ones asked for are clamped to it.
pub const MAX_TIMEOUT_S: f64 = 300.0;
/// Largest `memory_limit_MB`: larger ones are clamped to it.
pub const MAX_MEMORY_MB: i64 = 64 * 1024;
/// The fields of a run request.
const FIELDS: &[&str] = &[
    "code",
    "language",
    "stdin",
    "files",
    "fetch_files",
    "run_timeout",
    "compile_timeout",
    "memory_limit_MB",
    "output_limit",
    "template",
    "substrate",
];

/// A request the runner cannot take.
#[derive(Debug, thiserror::Error)]
pub enum BadRun {
    /// The body is not JSON.
    #[error("bad JSON body: {msg}")]
    Json {
        /// The parser's message.
        msg: String,
        /// Byte offset of the error.
        offset: usize,
    },
    /// The body (or a batch item) is JSON but not an object.
    #[error("a run request is a JSON object")]
    NotObject {
        /// What it was.
        input: Value,
    },
    /// Fields a run request does not have (refused by the native API only).
    #[error("unknown field{} {} (known: {})", if .0.len() == 1 { "" } else { "s" }, .0.join(", "), FIELDS.join(", "))]
    Unknown(Vec<String>),
    /// A field is missing or has a wrong type or value.
    #[error("{}{msg}", prefix(.loc))]
    Field {
        /// The field (and key within it).
        loc: Vec<String>,
        /// pydantic's error type (`missing`, `string_type`, `literal_error`, `value_error`…).
        kind: &'static str,
        /// What is wrong.
        msg: String,
        /// The value given (null when missing).
        input: Value,
    },
    /// A field is larger than the runner takes.
    #[error("{}{msg}", prefix(.loc))]
    TooLarge {
        /// The field.
        loc: Vec<String>,
        /// What is too large.
        msg: String,
    },
}

/// `a.b: ` for a field's location, nothing for the whole body.
fn prefix(loc: &[String]) -> String {
    if loc.is_empty() {
        String::new()
    } else {
        format!("{}: ", loc.join("."))
    }
}

impl BadRun {
    fn field(name: &str, kind: &'static str, msg: impl Into<String>, input: &Value) -> Self {
        Self::Field {
            loc: vec![name.to_owned()],
            kind,
            msg: msg.into(),
            input: input.clone(),
        }
    }

    fn value(loc: &[&str], msg: impl Into<String>, input: &Value) -> Self {
        Self::Field {
            loc: loc.iter().map(|s| (*s).to_owned()).collect(),
            kind: "value_error",
            msg: msg.into(),
            input: input.clone(),
        }
    }

    /// The `detail` of FastAPI's 422 answer: one error, located in the body.
    pub fn fastapi_detail(&self) -> Value {
        let at = |loc: &[String]| {
            let mut l = vec![json!("body")];
            l.extend(loc.iter().map(|s| json!(s)));
            l
        };
        let one = match self {
            Self::Json { msg, offset } => json!({
                "type": "json_invalid", "loc": ["body", offset], "msg": "JSON decode error",
                "input": {}, "ctx": {"error": msg},
            }),
            Self::NotObject { input } => json!({
                "type": "model_attributes_type", "loc": ["body"],
                "msg": "Input should be a valid dictionary or object to extract fields from",
                "input": input,
            }),
            Self::Unknown(names) => json!({
                "type": "extra_forbidden", "loc": ["body", names.first()],
                "msg": "Extra inputs are not permitted", "input": null,
            }),
            Self::Field {
                loc,
                kind,
                msg,
                input,
            } => {
                let msg = if *kind == "value_error" {
                    format!("Value error, {msg}")
                } else {
                    msg.clone()
                };
                json!({"type": kind, "loc": at(loc), "msg": msg, "input": input})
            }
            Self::TooLarge { loc, msg } => json!({
                "type": "value_error", "loc": at(loc), "msg": format!("Value error, {msg}"),
                "input": null,
            }),
        };
        json!([one])
    }
}

impl From<BadRun> for ApiError {
    fn from(e: BadRun) -> Self {
        let code = match e {
            BadRun::TooLarge { .. } => ErrorCode::TooLarge,
            _ => ErrorCode::InvalidRequest,
        };
        ApiError::new(code, e.to_string())
    }
}

/// Parses a JSON body into its object.
pub fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, BadRun> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(BadRun::NotObject { input: other }),
        Err(e) => Err(BadRun::Json {
            msg: e.to_string(),
            offset: offset_of(bytes, e.line(), e.column()),
        }),
    }
}

/// The byte offset of a 1-based line and column.
fn offset_of(bytes: &[u8], line: usize, column: usize) -> usize {
    let start: usize = bytes
        .split(|b| *b == b'\n')
        .take(line.saturating_sub(1))
        .map(|l| l.len() + 1)
        .sum();
    (start + column.saturating_sub(1)).min(bytes.len())
}

/// Whether unknown fields are refused (the native API) or ignored (SandboxFusion's routes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fields {
    /// Refused with [`BadRun::Unknown`].
    Strict,
    /// Ignored.
    Lenient,
}

/// A validated run.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub(super) lang: &'static Lang,
    pub(super) program: Program,
    pub(super) stdin: Vec<u8>,
    pub(super) files: Vec<(String, Vec<u8>)>,
    pub(super) fetch: Vec<String>,
    /// Zero: the phase times out at once.
    pub(super) run_timeout: Duration,
    pub(super) compile_timeout: Duration,
    pub(super) memory_bytes: Option<u64>,
    pub(super) output_limit: u64,
    pub(super) template: String,
    pub(super) substrate: Substrate,
    /// Fields whose value was out of the node's range, with the value applied.
    pub(super) clamped: BTreeMap<&'static str, f64>,
}

fn string(m: &Map<String, Value>, name: &str) -> Result<Option<String>, BadRun> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(BadRun::field(
            name,
            "string_type",
            "Input should be a valid string",
            v,
        )),
    }
}

/// A number, or a string that parses as one (pydantic's lax mode).
fn number(m: &Map<String, Value>, name: &str) -> Result<Option<f64>, BadRun> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v @ Value::String(s)) => match s.trim().parse::<f64>() {
            Ok(x) if !x.is_nan() => Ok(Some(x)),
            _ => Err(BadRun::field(
                name,
                "float_parsing",
                "Input should be a valid number, unable to parse string as a number",
                v,
            )),
        },
        Some(v) => Err(BadRun::field(
            name,
            "float_type",
            "Input should be a valid number",
            v,
        )),
    }
}

fn integer(m: &Map<String, Value>, name: &str) -> Result<Option<i64>, BadRun> {
    let Some(x) = number(m, name)? else {
        return Ok(None);
    };
    let v = &m[name];
    if x.fract() != 0.0 {
        return Err(BadRun::field(
            name,
            "int_from_float",
            "Input should be a valid integer, got a number with a fractional part",
            v,
        ));
    }
    if x.abs() > 9.0e15 {
        return Err(BadRun::value(&[name], "out of range", v));
    }
    Ok(Some(x as i64))
}

fn required(m: &Map<String, Value>, name: &str) -> Result<String, BadRun> {
    string(m, name)?.ok_or_else(|| BadRun::field(name, "missing", "Field required", &Value::Null))
}

fn rel_path(p: &str, field: &str) -> Result<(), BadRun> {
    let bad = p.is_empty()
        || p.len() > 255
        || p.starts_with('/')
        || p.contains('\0')
        || p.split('/').any(|c| c == ".." || c == "." || c.is_empty());
    if bad {
        return Err(BadRun::value(
            &[field, p],
            "file paths are relative, without '.', '..' or empty parts",
            &json!(p),
        ));
    }
    Ok(())
}

/// A phase timeout: any number is taken; above [`MAX_TIMEOUT_S`] it is clamped to it, and
/// at or below zero the phase times out at once (a negative one is clamped to zero).
fn timeout(
    v: Option<f64>,
    name: &'static str,
    clamped: &mut BTreeMap<&'static str, f64>,
) -> Duration {
    let s = v.unwrap_or(10.0);
    let applied = s.clamp(0.0, MAX_TIMEOUT_S);
    if applied != s {
        clamped.insert(name, applied);
    }
    Duration::from_secs_f64(applied)
}

/// A collection field of at most [`MAX_FILES`] entries: `None` when absent or null, else what
/// `take` makes of it (with its length), or a `kind` error when `take` makes nothing of it.
fn collection<'a, T>(
    m: &'a Map<String, Value>,
    key: &'static str,
    (kind, msg): (&'static str, &'static str),
    take: impl FnOnce(&'a Value) -> Option<(T, usize)>,
) -> Result<Option<T>, BadRun> {
    let v = match m.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let (t, len) = take(v).ok_or_else(|| BadRun::field(key, kind, msg, v))?;
    if len > MAX_FILES {
        let msg = format!("at most {MAX_FILES} {key}");
        return Err(BadRun::value(&[key], msg, &Value::Null));
    }
    Ok(Some(t))
}

fn files(m: &Map<String, Value>) -> Result<Vec<(String, Vec<u8>)>, BadRun> {
    let dict = ("dict_type", "Input should be a valid dictionary");
    let Some(obj) = collection(m, "files", dict, |v| v.as_object().map(|o| (o, o.len())))? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    let mut total = 0usize;
    for (p, v) in obj {
        rel_path(p, "files")?;
        let data = match v {
            Value::Null => Vec::new(),
            Value::String(s) => B64.decode(s.as_bytes()).map_err(|e| {
                BadRun::value(
                    &["files", p],
                    format!("not valid base64: {e}"),
                    &json!(s.chars().take(64).collect::<String>()),
                )
            })?,
            other => {
                return Err(BadRun::Field {
                    loc: vec!["files".into(), p.clone()],
                    kind: "string_type",
                    msg: "Input should be a valid string".into(),
                    input: other.clone(),
                })
            }
        };
        total += data.len();
        if total > MAX_FILES_BYTES {
            return Err(BadRun::TooLarge {
                loc: vec!["files".into()],
                msg: format!("files exceed {MAX_FILES_BYTES} bytes in total"),
            });
        }
        out.push((p.clone(), data));
    }
    Ok(out)
}

fn fetch_files<'a>(m: &'a Map<String, Value>) -> Result<Vec<String>, BadRun> {
    let listed = ("list_type", "Input should be a valid list");
    let take = |v: &'a Value| v.as_array().map(|a| (a, a.len()));
    let Some(list) = collection(m, "fetch_files", listed, take)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (i, v) in list.iter().enumerate() {
        let Value::String(p) = v else {
            return Err(BadRun::Field {
                loc: vec!["fetch_files".into(), i.to_string()],
                kind: "string_type",
                msg: "Input should be a valid string".into(),
                input: v.clone(),
            });
        };
        rel_path(p, "fetch_files")?;
        out.push(p.clone());
    }
    Ok(out)
}

/// Validates a run request; `template` is the one of a request that names none.
pub fn validate(m: &Map<String, Value>, fields: Fields, template: &str) -> Result<RunSpec, BadRun> {
    if fields == Fields::Strict {
        let unknown: Vec<String> = m
            .keys()
            .filter(|k| !FIELDS.contains(&k.as_str()))
            .map(|k| k.chars().take(64).collect())
            .collect();
        if !unknown.is_empty() {
            return Err(BadRun::Unknown(unknown));
        }
    }
    let code = required(m, "code")?;
    if code.len() > MAX_CODE {
        return Err(BadRun::TooLarge {
            loc: vec!["code".into()],
            msg: format!("code exceeds {MAX_CODE} bytes"),
        });
    }
    let name = required(m, "language")?;
    let lang = lang::find(&name).ok_or_else(|| BadRun::Field {
        loc: vec!["language".into()],
        kind: "literal_error",
        msg: format!("Input should be one of: {}", lang::known()),
        input: json!(name.chars().take(32).collect::<String>()),
    })?;
    let substrate = match string(m, "substrate")?.as_deref() {
        None => None,
        Some("function") => Some(Substrate::Function),
        Some("container") => Some(Substrate::Container),
        Some(other) => {
            return Err(BadRun::field(
                "substrate",
                "literal_error",
                "Input should be 'function' or 'container'",
                &json!(other),
            ))
        }
    };
    let substrate = match (substrate, lang.name) {
        (Some(Substrate::Function) | None, "python") => Substrate::Function,
        (Some(Substrate::Function), other) => {
            return Err(BadRun::value(
                &["substrate"],
                format!("the function substrate runs python only, not {other}"),
                &json!("function"),
            ))
        }
        // (The parse above gives no VM substrate: the runner runs on these two.)
        (Some(Substrate::Container | Substrate::Microvm | Substrate::Vm) | None, _) => {
            Substrate::Container
        }
    };
    let cap_max = match substrate {
        Substrate::Function => FUNCTION_OUTPUT_MAX,
        Substrate::Container | Substrate::Microvm | Substrate::Vm => {
            dsec_api::exec::MAX_OUTPUT_LIMIT
        }
    };
    let output_limit = match integer(m, "output_limit")? {
        None => FUNCTION_OUTPUT_MAX,
        Some(n) if n >= 1 && n as u64 <= cap_max => n as u64,
        Some(_) => {
            return Err(BadRun::value(
                &["output_limit"],
                format!("must be in 1..={cap_max} on this substrate"),
                &m["output_limit"],
            ))
        }
    };
    let mut clamped = BTreeMap::new();
    let memory_bytes = match integer(m, "memory_limit_MB")? {
        None | Some(..=0) => None,
        Some(mb) => {
            if mb > MAX_MEMORY_MB {
                clamped.insert("memory_limit_MB", MAX_MEMORY_MB as f64);
            }
            Some(mb.min(MAX_MEMORY_MB) as u64 * 1024 * 1024)
        }
    };
    let template = string(m, "template")?.unwrap_or_else(|| template.to_owned());
    crate::template::validate_name(&template)
        .map_err(|e| BadRun::value(&["template"], e.to_string(), &json!(template)))?;
    Ok(RunSpec {
        lang,
        program: lang.program(&code),
        stdin: string(m, "stdin")?.unwrap_or_default().into_bytes(),
        files: files(m)?,
        fetch: fetch_files(m)?,
        run_timeout: timeout(number(m, "run_timeout")?, "run_timeout", &mut clamped),
        compile_timeout: timeout(
            number(m, "compile_timeout")?,
            "compile_timeout",
            &mut clamped,
        ),
        memory_bytes,
        output_limit,
        template,
        substrate,
        clamped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: Value, fields: Fields) -> Result<RunSpec, BadRun> {
        let Value::Object(m) = v else {
            panic!("not an object")
        };
        validate(&m, fields, "host")
    }

    #[test]
    fn unknown_fields_are_refused_strictly_and_ignored_leniently() {
        let body =
            json!({"code": "1", "language": "python", "task_id": "HumanEval/1", "test": "x"});
        let err = spec(body.clone(), Fields::Strict).expect_err("refused");
        assert!(
            matches!(&err, BadRun::Unknown(n) if n == &["task_id", "test"]),
            "{err}"
        );
        assert_eq!(
            ApiError::from(err).code,
            ErrorCode::InvalidRequest,
            "a typed error"
        );
        let s = spec(body, Fields::Lenient).expect("taken");
        assert_eq!(s.lang.name, "python");
    }

    #[test]
    fn timeouts_outside_the_range_are_clamped_and_reported() {
        let s = spec(
            json!({"code": "1", "language": "cpp", "run_timeout": 1000, "compile_timeout": -3}),
            Fields::Strict,
        )
        .expect("taken");
        assert_eq!(s.run_timeout, Duration::from_secs(300));
        assert_eq!(s.compile_timeout, Duration::ZERO);
        assert_eq!(
            s.clamped,
            BTreeMap::from([("compile_timeout", 0.0), ("run_timeout", 300.0)])
        );
        let s = spec(
            json!({"code": "1", "language": "python", "run_timeout": 0, "compile_timeout": "2.5"}),
            Fields::Lenient,
        )
        .expect("taken");
        assert_eq!(s.run_timeout, Duration::ZERO);
        assert_eq!(s.compile_timeout, Duration::from_millis(2500));
        assert!(s.clamped.is_empty(), "{:?}", s.clamped);
        let s = spec(
            json!({"code": "1", "language": "python", "memory_limit_MB": 1e7}),
            Fields::Lenient,
        )
        .expect("taken");
        assert_eq!(s.memory_bytes, Some((MAX_MEMORY_MB as u64) << 20));
        assert_eq!(
            s.clamped,
            BTreeMap::from([("memory_limit_MB", MAX_MEMORY_MB as f64)])
        );
    }

    #[test]
    fn bad_fields_are_located_like_fastapi() {
        let cases = [
            (
                json!({"language": "python"}),
                "missing",
                json!(["body", "code"]),
            ),
            (
                json!({"code": "1", "language": "cobol"}),
                "literal_error",
                json!(["body", "language"]),
            ),
            (
                json!({"code": "1", "language": "python", "run_timeout": "soon"}),
                "float_parsing",
                json!(["body", "run_timeout"]),
            ),
            (
                json!({"code": "1", "language": "python", "run_timeout": "nan"}),
                "float_parsing",
                json!(["body", "run_timeout"]),
            ),
            (
                json!({"code": 1, "language": "python"}),
                "string_type",
                json!(["body", "code"]),
            ),
            (
                json!({"code": "1", "language": "python", "files": {"a": "!!"}}),
                "value_error",
                json!(["body", "files", "a"]),
            ),
            (
                json!({"code": "1", "language": "python", "fetch_files": "a"}),
                "list_type",
                json!(["body", "fetch_files"]),
            ),
        ];
        for (body, kind, loc) in cases {
            let err = spec(body.clone(), Fields::Lenient)
                .err()
                .unwrap_or_else(|| panic!("{body} taken"));
            let d = err.fastapi_detail();
            assert_eq!(d[0]["type"], kind, "{body}: {d}");
            assert_eq!(d[0]["loc"], loc, "{body}: {d}");
            assert!(d[0]["msg"].as_str().is_some_and(|m| !m.is_empty()), "{d}");
        }
        let err = parse_object(b"{\"code\": \n  oops}").expect_err("bad JSON");
        let d = err.fastapi_detail();
        assert_eq!(d[0]["type"], "json_invalid", "{d}");
        assert_eq!(d[0]["loc"], json!(["body", 12]), "{d}");
        let err = parse_object(b"[1]").expect_err("not an object");
        assert_eq!(err.fastapi_detail()[0]["loc"], json!(["body"]));
    }

    #[test]
    fn too_large_inputs_keep_their_code() {
        let err = spec(
            json!({"code": "x".repeat(MAX_CODE + 1), "language": "python"}),
            Fields::Lenient,
        )
        .expect_err("refused");
        assert_eq!(ApiError::from(err).code, ErrorCode::TooLarge);
    }
}
