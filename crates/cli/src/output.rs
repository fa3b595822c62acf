//! Human output of the client commands: tables, ages, sizes, JSON.

use std::io::Write;

use serde_json::Value;

use crate::client::ClientError;

/// Writes `bytes` to stdout (or stderr) and flushes.
pub fn write_out(bytes: &[u8], to_stderr: bool) -> Result<(), ClientError> {
    let r = if to_stderr {
        let mut e = std::io::stderr().lock();
        e.write_all(bytes).and_then(|()| e.flush())
    } else {
        let mut o = std::io::stdout().lock();
        o.write_all(bytes).and_then(|()| o.flush())
    };
    r.map_err(|source| ClientError::Local {
        what: format!("write to {}", if to_stderr { "stderr" } else { "stdout" }),
        source,
    })
}

/// Prints `v` as pretty JSON on stdout.
pub fn print_json(v: &Value) -> Result<(), ClientError> {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
    s.push('\n');
    write_out(s.as_bytes(), false)
}

/// Prints a table with left-aligned columns separated by two spaces.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) -> Result<(), ClientError> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, (c, w)) in cells.zip(&widths).enumerate() {
            if i + 1 == widths.len() {
                l.push_str(c);
            } else {
                l.push_str(&format!("{c:<w$}  "));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for r in rows {
        line(&mut r.iter().map(String::as_str));
    }
    write_out(out.as_bytes(), false)
}

/// Prints a list answer's `items`: as a JSON array with `json`, else as a table with `header`
/// and one row per item made by `row`.
pub fn print_items(
    answer: &Value,
    json: bool,
    header: &[&str],
    row: impl Fn(&Value) -> Vec<String>,
) -> Result<(), ClientError> {
    let items = answer["items"].as_array().map_or(&[][..], Vec::as_slice);
    if json {
        return print_json(&Value::Array(items.to_vec()));
    }
    let rows: Vec<Vec<String>> = items.iter().map(row).collect();
    print_table(header, &rows)
}

/// A JSON scalar as text: strings bare, `null` as `-`.
pub fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| format!("{k}={}", text(v)))
            .collect::<Vec<_>>()
            .join(","),
        Value::Array(a) => a.iter().map(text).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

/// Bytes as `512M`, `1G`, `1.5G`, or the plain number when below 1K.
pub fn size(n: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "T"),
        (1 << 30, "G"),
        (1 << 20, "M"),
        (1 << 10, "K"),
    ];
    for (m, u) in UNITS {
        if n >= m {
            let v = n as f64 / m as f64;
            return if n.is_multiple_of(m) {
                format!("{}{u}", n / m)
            } else {
                format!("{v:.1}{u}")
            };
        }
    }
    n.to_string()
}

/// Milliseconds since the epoch of an RFC 3339 UTC time as the daemon writes it
/// (`2024-05-01T12:00:00.123Z`).
pub fn parse_rfc3339_ms(s: &str) -> Option<u64> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-').map(str::parse::<i64>);
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.splitn(3, ':').map(str::parse::<i64>);
    let (hh, mm, ss) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let ms: i64 = format!("{frac:0<3}").get(..3)?.parse().ok()?;
    // Days since 1970-01-01 of a civil date (H. Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let total = ((days * 86_400 + hh * 3600 + mm * 60 + ss) * 1000) + ms;
    u64::try_from(total).ok()
}

/// The age of an RFC 3339 time: `12s`, `5m`, `3h`, `2d`.
pub fn age(created: &str) -> String {
    let Some(at) = parse_rfc3339_ms(created) else {
        return "-".into();
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let s = now.saturating_sub(at) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// Prints the phases of a VM preparation on stderr as they happen: a line per phase, and on a
/// terminal a progress bar for the long ones.
pub struct PhaseReport {
    what: String,
    tty: bool,
    /// Last percentage drawn.
    drawn: std::sync::Mutex<Option<u64>>,
}

impl PhaseReport {
    /// For the preparation of `what` (a substrate name).
    pub fn new(what: &str) -> Self {
        use std::io::IsTerminal as _;
        Self {
            what: what.to_owned(),
            tty: std::io::stderr().is_terminal(),
            drawn: std::sync::Mutex::new(None),
        }
    }

    /// Reports `e`.
    pub fn event(&self, e: dsec_node::substrate::vm::Event) {
        use dsec_node::substrate::vm::Event;
        let mut drawn = self.drawn.lock().unwrap_or_else(|p| p.into_inner());
        let line = match e {
            Event::Start(p) => {
                *drawn = None;
                format!("{}: {} ...", self.what, p.name())
            }
            Event::Progress(p, f) => {
                let pct = (f.clamp(0.0, 1.0) * 100.0) as u64;
                if !self.tty || *drawn == Some(pct) {
                    return;
                }
                *drawn = Some(pct);
                format!("{}: {} {} {pct:>3}%", self.what, p.name(), bar(f, 30))
            }
            Event::Done(p, took) => {
                *drawn = None;
                format!(
                    "{}: {} done in {:.1} s",
                    self.what,
                    p.name(),
                    took.as_secs_f64()
                )
            }
        };
        let mut err = std::io::stderr().lock();
        let _ = if self.tty {
            // Redraw the current line; a phase's end leaves it.
            let end = if matches!(e, Event::Done(..)) {
                "\n"
            } else {
                ""
            };
            write!(err, "\r{line}\x1b[K{end}")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    }
}

/// A text progress bar `[#####.....]` of `width` cells for `fraction` done.
fn bar(fraction: f64, width: usize) -> String {
    let full = ((fraction.clamp(0.0, 1.0) * width as f64) as usize).min(width);
    format!("[{}{}]", "#".repeat(full), ".".repeat(width - full))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_bar() {
        assert_eq!(bar(0.0, 4), "[....]");
        assert_eq!(bar(0.5, 4), "[##..]");
        assert_eq!(bar(1.5, 4), "[####]");
    }

    #[test]
    fn times() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00.000Z"), Some(0));
        assert_eq!(
            parse_rfc3339_ms("2024-03-01T01:02:03.456Z"),
            Some(1_709_254_923_456)
        );
        assert_eq!(
            parse_rfc3339_ms("2024-03-01T01:02:03Z"),
            Some(1_709_254_923_000)
        );
        assert_eq!(parse_rfc3339_ms("garbage"), None);
    }

    #[test]
    fn sizes() {
        assert_eq!(size(512 << 20), "512M");
        assert_eq!(size(3 << 29), "1.5G");
        assert_eq!(size(100), "100");
    }

    #[test]
    fn texts() {
        assert_eq!(text(&serde_json::json!({"a": "b", "c": 1})), "a=b,c=1");
        assert_eq!(text(&Value::Null), "-");
    }
}
