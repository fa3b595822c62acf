//! The daemon's logs: `tracing` events written as one JSON object per line on stderr, with the
//! fields of the spans they happen in (the API's `request` span carries `request_id`).
//!
//! A line is `{"level", "msg", "ts_ms", ...fields}` (keys sorted, every value a string as
//! written). Nothing a sandbox does writes a log line by itself: lines come from lifecycle
//! changes and API errors, which API rate limits and quotas bound.

use std::fmt;
use std::io::Write as _;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

tokio::task_local! {
    /// The id of the request being served (set by the API's request-id middleware; problem
    /// documents carry it).
    pub static REQUEST_ID: String;
}

/// The current request's id, or `-` outside a request.
pub fn request_id() -> String {
    REQUEST_ID
        .try_with(Clone::clone)
        .unwrap_or_else(|_| "-".into())
}

/// Installs the JSON log layer as the process's subscriber (info and above). A second call,
/// or a process that has a subscriber already, keeps the first.
pub fn init() {
    let subscriber = tracing_subscriber::registry()
        .with(JsonLines)
        .with(LevelFilter::INFO);
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// Fields of an event or a span, as strings.
#[derive(Debug, Default)]
struct Fields(Map<String, Value>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, format!("{value:?}"));
    }
}

impl Fields {
    fn put(&mut self, field: &Field, value: String) {
        let name = match field.name() {
            "message" => "msg",
            n => n,
        };
        self.0.insert(name.to_owned(), Value::String(value));
    }
}

/// The layer that writes each event as a JSON line.
struct JsonLines;

impl<S> Layer<S> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                values.record(fields);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut obj = Map::new();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<Fields>() {
                    obj.extend(fields.0.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
            }
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        obj.extend(fields.0);
        obj.insert("ts_ms".into(), Value::from(crate::clock::now_ms()));
        obj.insert("level".into(), level_name(*event.metadata().level()).into());
        let line = Value::Object(obj).to_string();
        let _ = writeln!(std::io::stderr().lock(), "{line}");
    }
}

fn level_name(level: Level) -> &'static str {
    match level {
        Level::ERROR => "error",
        Level::WARN => "warn",
        Level::INFO => "info",
        Level::DEBUG => "debug",
        Level::TRACE => "trace",
    }
}
