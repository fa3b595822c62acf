//! Training-ready export of trajectory steps: JSON Lines and Apache Parquet.
//!
//! The input is one [`ExportRow`] per step (the caller joins a step's intent, result and
//! annotations). Both formats carry the same columns, in this order:
//!
//! | column           | JSONL                  | Parquet                                       |
//! |------------------|------------------------|-----------------------------------------------|
//! | `trajectory`     | string                 | `REQUIRED BYTE_ARRAY (UTF8)`                  |
//! | `step`           | number                 | `REQUIRED INT64`                              |
//! | `action`         | JSON value (embedded)  | `REQUIRED BYTE_ARRAY (UTF8)`, the JSON text   |
//! | `observation`    | JSON value (embedded)  | `REQUIRED BYTE_ARRAY (UTF8)`, the JSON text   |
//! | `exit_status`    | string or null         | `OPTIONAL BYTE_ARRAY (UTF8)`                  |
//! | `exit_code`      | number or null         | `OPTIONAL INT64`                              |
//! | `wall_us`        | number or null         | `OPTIONAL INT64`                              |
//! | `started_at_ms`  | number or null         | `OPTIONAL INT64`                              |
//! | `finished_at_ms` | number or null         | `OPTIONAL INT64`                              |
//! | `reward`         | number or null         | `OPTIONAL DOUBLE`                             |
//! | `labels`         | array of strings       | `REQUIRED group (LIST)` of `REQUIRED` strings |
//! | `annotations`    | JSON value (embedded)  | `REQUIRED BYTE_ARRAY (UTF8)`, the JSON text   |
//!
//! In Parquet the JSON columns stay JSON text (a reader parses them, e.g. `pyarrow` then
//! `json.loads`), `labels` is the standard three-level list (`labels.list.element`), so Arrow
//! readers see `list<string>`. Pages are uncompressed (the crate is built without codecs);
//! dictionary encoding is on for the short repetitive columns and off for the JSON ones. Rows go
//! into row groups of at most [`ROW_GROUP_ROWS`] rows or about [`ROW_GROUP_BYTES`] of text.
//!
//! JSONL embeds the JSON columns verbatim (their text is validated, not re-serialised, so key
//! order and number spelling survive; line breaks between tokens become spaces). An empty
//! `annotations` text counts as `{}`. A non-finite reward is written as `null` in JSONL.

use std::io::{self, Write};
use std::sync::Arc;

use parquet::basic::{Compression, Encoding};
use parquet::column::writer::ColumnWriter;
use parquet::data_type::ByteArray;
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use parquet::schema::types::ColumnPath;

/// One exported step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ExportRow {
    /// Trajectory id.
    pub trajectory: String,
    /// Step number.
    pub step: u64,
    /// JSON text of the request.
    pub action: String,
    /// JSON text of the response.
    pub observation: String,
    /// Exit status (`ok`, `timeout`, …), if the step has a result.
    pub exit_status: Option<String>,
    /// Exit code, if the process exited.
    pub exit_code: Option<i64>,
    /// Wall time in microseconds.
    pub wall_us: Option<i64>,
    /// Start, milliseconds since the Unix epoch.
    pub started_at_ms: Option<i64>,
    /// End, milliseconds since the Unix epoch.
    pub finished_at_ms: Option<i64>,
    /// Reward annotation.
    pub reward: Option<f64>,
    /// Label annotations.
    pub labels: Vec<String>,
    /// JSON text of free-form annotations, `{}` if none.
    pub annotations: String,
}

/// Most rows in one Parquet row group.
pub const ROW_GROUP_ROWS: usize = 64 * 1024;
/// A Parquet row group is closed once its rows hold this many bytes of text (128 MiB).
pub const ROW_GROUP_BYTES: usize = 128 << 20;

/// The Parquet schema of an export (see the module docs).
pub const PARQUET_SCHEMA: &str = "
message trajectory_step {
  REQUIRED BYTE_ARRAY trajectory (UTF8);
  REQUIRED INT64 step;
  REQUIRED BYTE_ARRAY action (UTF8);
  REQUIRED BYTE_ARRAY observation (UTF8);
  OPTIONAL BYTE_ARRAY exit_status (UTF8);
  OPTIONAL INT64 exit_code;
  OPTIONAL INT64 wall_us;
  OPTIONAL INT64 started_at_ms;
  OPTIONAL INT64 finished_at_ms;
  OPTIONAL DOUBLE reward;
  REQUIRED group labels (LIST) {
    REPEATED group list {
      REQUIRED BYTE_ARRAY element (UTF8);
    }
  }
  REQUIRED BYTE_ARRAY annotations (UTF8);
}
";

/// Why a Parquet export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// Building the writer (schema, header) failed.
    #[error("parquet export: start the file")]
    Start(#[source] parquet::errors::ParquetError),
    /// Writing a column chunk of a row group failed (including the output's write errors).
    #[error("parquet export: write column {column} of row group {row_group}")]
    WriteColumn {
        /// The column's name.
        column: String,
        /// The row group's index.
        row_group: usize,
        /// The cause.
        #[source]
        source: parquet::errors::ParquetError,
    },
    /// Closing a row group or writing the footer failed.
    #[error("parquet export: finish the file")]
    Finish(#[source] parquet::errors::ParquetError),
}

/// Writes `rows` as JSON Lines: one object per row, with `action`, `observation` and
/// `annotations` embedded as JSON values. A row whose JSON text does not parse fails with
/// [`io::ErrorKind::InvalidData`] naming the trajectory, step and column; the lines before it
/// have been written.
pub fn to_jsonl(rows: &[ExportRow], out: &mut impl Write) -> io::Result<()> {
    let mut line = Vec::with_capacity(4096);
    for row in rows {
        line.clear();
        jsonl_line(row, &mut line)?;
        out.write_all(&line)?;
    }
    out.flush()
}

fn jsonl_line(row: &ExportRow, line: &mut Vec<u8>) -> io::Result<()> {
    let annotations = if row.annotations.trim().is_empty() {
        "{}"
    } else {
        &row.annotations
    };
    line.extend_from_slice(b"{\"trajectory\":");
    serde_json::to_writer(&mut *line, &row.trajectory)?;
    line.extend_from_slice(format!(",\"step\":{}", row.step).as_bytes());
    for (key, text) in [
        ("action", &row.action[..]),
        ("observation", &row.observation),
    ] {
        line.extend_from_slice(format!(",\"{key}\":").as_bytes());
        embed_json(row, key, text, line)?;
    }
    line.extend_from_slice(b",\"exit_status\":");
    serde_json::to_writer(&mut *line, &row.exit_status)?;
    for (key, v) in [
        ("exit_code", row.exit_code),
        ("wall_us", row.wall_us),
        ("started_at_ms", row.started_at_ms),
        ("finished_at_ms", row.finished_at_ms),
    ] {
        line.extend_from_slice(format!(",\"{key}\":").as_bytes());
        serde_json::to_writer(&mut *line, &v)?;
    }
    line.extend_from_slice(b",\"reward\":");
    // serde_json writes a non-finite float as null.
    serde_json::to_writer(&mut *line, &row.reward)?;
    line.extend_from_slice(b",\"labels\":");
    serde_json::to_writer(&mut *line, &row.labels)?;
    line.extend_from_slice(b",\"annotations\":");
    embed_json(row, "annotations", annotations, line)?;
    line.extend_from_slice(b"}\n");
    Ok(())
}

/// Appends `text` to `line` if it is one valid JSON value. Raw line breaks in valid JSON can
/// only be whitespace between tokens (inside strings they are escaped), so they become spaces.
fn embed_json(row: &ExportRow, column: &str, text: &str, line: &mut Vec<u8>) -> io::Result<()> {
    if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(text) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "trajectory {} step {}: {column} is not JSON: {e}",
                row.trajectory, row.step
            ),
        ));
    }
    line.extend(text.trim().bytes().map(|b| match b {
        b'\n' | b'\r' => b' ',
        b => b,
    }));
    Ok(())
}

fn writer_properties() -> WriterProperties {
    let mut b = WriterProperties::builder()
        .set_compression(Compression::UNCOMPRESSED)
        .set_created_by(concat!("dsec ", env!("CARGO_PKG_VERSION")).to_owned());
    for col in ["action", "observation", "annotations"] {
        b = b
            .set_column_dictionary_enabled(ColumnPath::from(col), false)
            .set_column_encoding(ColumnPath::from(col), Encoding::PLAIN);
    }
    b.build()
}

/// Writes `rows` as one Parquet file (schema [`PARQUET_SCHEMA`], see the module docs). The JSON
/// columns are stored as their text, not validated.
pub fn to_parquet(rows: &[ExportRow], out: &mut (impl Write + Send)) -> Result<(), ExportError> {
    let schema = Arc::new(parse_message_type(PARQUET_SCHEMA).map_err(ExportError::Start)?);
    let mut file = SerializedFileWriter::new(out, schema, Arc::new(writer_properties()))
        .map_err(ExportError::Start)?;
    for (index, group) in row_groups(rows).enumerate() {
        let mut rg = file.next_row_group().map_err(ExportError::Finish)?;
        let mut column = 0;
        loop {
            let name = COLUMNS.get(column).copied().unwrap_or("?");
            let wrap = |source| ExportError::WriteColumn {
                column: name.to_owned(),
                row_group: index,
                source,
            };
            let Some(mut col) = rg.next_column().map_err(wrap)? else {
                break;
            };
            write_column(column, group, col.untyped()).map_err(wrap)?;
            col.close().map_err(wrap)?;
            column += 1;
        }
        rg.close().map_err(ExportError::Finish)?;
    }
    file.close().map_err(ExportError::Finish)?;
    Ok(())
}

/// Leaf columns in schema order.
const COLUMNS: [&str; 12] = [
    "trajectory",
    "step",
    "action",
    "observation",
    "exit_status",
    "exit_code",
    "wall_us",
    "started_at_ms",
    "finished_at_ms",
    "reward",
    "labels",
    "annotations",
];

fn row_text_bytes(r: &ExportRow) -> usize {
    r.trajectory.len()
        + r.action.len()
        + r.observation.len()
        + r.annotations.len()
        + r.labels.iter().map(String::len).sum::<usize>()
}

/// Splits `rows` into row groups bounded by [`ROW_GROUP_ROWS`] and [`ROW_GROUP_BYTES`]; every
/// group has at least one row.
fn row_groups(rows: &[ExportRow]) -> impl Iterator<Item = &[ExportRow]> {
    let mut rest = rows;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut bytes = 0;
        let mut n = 0;
        while n < rest.len() && n < ROW_GROUP_ROWS && (n == 0 || bytes < ROW_GROUP_BYTES) {
            bytes += row_text_bytes(&rest[n]);
            n += 1;
        }
        let (group, tail) = rest.split_at(n);
        rest = tail;
        Some(group)
    })
}

fn text(s: &str) -> ByteArray {
    ByteArray::from(s.as_bytes().to_vec())
}

/// Values and definition levels of an optional column (level 1 = present).
fn optional<'a, U>(
    rows: &'a [ExportRow],
    get: impl Fn(&'a ExportRow) -> Option<U>,
) -> (Vec<U>, Vec<i16>) {
    let mut values = Vec::with_capacity(rows.len());
    let mut def = Vec::with_capacity(rows.len());
    for r in rows {
        match get(r) {
            Some(v) => {
                values.push(v);
                def.push(1);
            }
            None => def.push(0),
        }
    }
    (values, def)
}

fn write_column(
    column: usize,
    rows: &[ExportRow],
    w: &mut ColumnWriter<'_>,
) -> parquet::errors::Result<()> {
    use ColumnWriter::{
        ByteArrayColumnWriter as Bytes, DoubleColumnWriter as F64, Int64ColumnWriter as I64,
    };
    match (column, w) {
        (0 | 2 | 3, Bytes(w)) => {
            let get: fn(&ExportRow) -> &str = match column {
                0 => |r| &r.trajectory,
                2 => |r| &r.action,
                _ => |r| &r.observation,
            };
            let v: Vec<ByteArray> = rows.iter().map(|r| text(get(r))).collect();
            w.write_batch(&v, None, None)?;
        }
        (1, I64(w)) => {
            // Steps above i64::MAX do not occur (the log's steps come from clients as JSON
            // integers); they would wrap, so clamp instead.
            let v: Vec<i64> = rows
                .iter()
                .map(|r| i64::try_from(r.step).unwrap_or(i64::MAX))
                .collect();
            w.write_batch(&v, None, None)?;
        }
        (4, Bytes(w)) => {
            let (v, def) = optional(rows, |r| r.exit_status.as_deref().map(text));
            w.write_batch(&v, Some(&def), None)?;
        }
        (5..=8, I64(w)) => {
            let get: fn(&ExportRow) -> Option<i64> = match column {
                5 => |r| r.exit_code,
                6 => |r| r.wall_us,
                7 => |r| r.started_at_ms,
                _ => |r| r.finished_at_ms,
            };
            let (v, def) = optional(rows, get);
            w.write_batch(&v, Some(&def), None)?;
        }
        (9, F64(w)) => {
            let (v, def) = optional(rows, |r| r.reward);
            w.write_batch(&v, Some(&def), None)?;
        }
        (10, Bytes(w)) => {
            // labels.list.element: max definition level 1 (a list entry exists), max
            // repetition level 1. An empty list is one level pair (0, 0) without a value.
            let mut v = Vec::new();
            let (mut def, mut rep) = (Vec::new(), Vec::new());
            for r in rows {
                if r.labels.is_empty() {
                    def.push(0);
                    rep.push(0);
                }
                for (i, l) in r.labels.iter().enumerate() {
                    v.push(text(l));
                    def.push(1);
                    rep.push(i16::from(i > 0));
                }
            }
            w.write_batch(&v, Some(&def), Some(&rep))?;
        }
        (11, Bytes(w)) => {
            let v: Vec<ByteArray> = rows
                .iter()
                .map(|r| {
                    if r.annotations.trim().is_empty() {
                        text("{}")
                    } else {
                        text(&r.annotations)
                    }
                })
                .collect();
            w.write_batch(&v, None, None)?;
        }
        (c, _) => {
            return Err(parquet::errors::ParquetError::General(format!(
                "invariant: column {c} does not match the export schema"
            )))
        }
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::{Field, RowAccessor};

    fn rows() -> Vec<ExportRow> {
        vec![
            ExportRow {
                trajectory: "run-1".into(),
                step: 0,
                action: r#"{"argv":["ls","-l"],"env":{"A":"1"}}"#.into(),
                observation: "{\n  \"status\": \"ok\",\n  \"stdout\": \"a\\nb\"\n}".into(),
                exit_status: Some("ok".into()),
                exit_code: Some(0),
                wall_us: Some(1234),
                started_at_ms: Some(1_700_000_000_000),
                finished_at_ms: Some(1_700_000_000_002),
                reward: Some(0.5),
                labels: vec!["good".into(), "fast".into()],
                annotations: r#"{"note":"ünïcode ✓","n":1.50}"#.into(),
            },
            ExportRow {
                trajectory: "run-1".into(),
                step: 1,
                action: r#"{"argv":["false"]}"#.into(),
                observation: "null".into(),
                annotations: String::new(),
                ..ExportRow::default()
            },
            ExportRow {
                trajectory: "run-2".into(),
                step: 7,
                action: "[]".into(),
                observation: r#"{"status":"timeout"}"#.into(),
                exit_status: Some("timeout".into()),
                exit_code: None,
                wall_us: Some(-1),
                reward: Some(f64::NAN),
                labels: vec!["only".into()],
                annotations: "{}".into(),
                ..ExportRow::default()
            },
        ]
    }

    #[test]
    fn jsonl_lines_parse_and_embed_json() -> anyhow::Result<()> {
        let rows = rows();
        let mut out = Vec::new();
        to_jsonl(&rows, &mut out)?;
        let text = String::from_utf8(out)?;
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        let v: Vec<serde_json::Value> = lines
            .iter()
            .map(|l| serde_json::from_str(l))
            .collect::<Result<_, _>>()?;
        assert_eq!(v[0]["trajectory"], "run-1");
        assert_eq!(v[0]["step"], 0);
        assert_eq!(v[0]["action"]["argv"][1], "-l");
        assert_eq!(v[0]["observation"]["stdout"], "a\nb");
        assert_eq!(v[0]["exit_status"], "ok");
        assert_eq!(v[0]["exit_code"], 0);
        assert_eq!(v[0]["wall_us"], 1234);
        assert_eq!(v[0]["finished_at_ms"], 1_700_000_000_002i64);
        assert_eq!(v[0]["reward"], 0.5);
        assert_eq!(v[0]["labels"], serde_json::json!(["good", "fast"]));
        assert_eq!(v[0]["annotations"]["note"], "ünïcode ✓");
        // Embedded verbatim: the number keeps its spelling.
        assert!(lines[0].contains(r#""n":1.50"#));
        assert_eq!(v[1]["observation"], serde_json::Value::Null);
        assert_eq!(v[1]["exit_status"], serde_json::Value::Null);
        assert_eq!(v[1]["labels"], serde_json::json!([]));
        assert_eq!(v[1]["annotations"], serde_json::json!({}));
        assert_eq!(v[2]["action"], serde_json::json!([]));
        assert_eq!(v[2]["reward"], serde_json::Value::Null);
        assert_eq!(v[2]["wall_us"], -1);
        Ok(())
    }

    #[test]
    fn jsonl_rejects_invalid_json_naming_the_step() -> anyhow::Result<()> {
        let mut rows = rows();
        rows[1].observation = "{not json".into();
        let mut out = Vec::new();
        let e = to_jsonl(&rows, &mut out).expect_err("invalid JSON is refused");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let msg = e.to_string();
        assert!(msg.contains("run-1") && msg.contains("step 1") && msg.contains("observation"));
        // The first line went out whole.
        assert_eq!(String::from_utf8(out)?.lines().count(), 1);
        Ok(())
    }

    #[test]
    fn jsonl_of_nothing_is_empty() -> anyhow::Result<()> {
        let mut out = Vec::new();
        to_jsonl(&[], &mut out)?;
        assert!(out.is_empty());
        Ok(())
    }

    fn reader(bytes: &[u8]) -> anyhow::Result<SerializedFileReader<std::fs::File>> {
        let mut f = tempfile::tempfile()?;
        f.write_all(bytes)?;
        Ok(SerializedFileReader::new(f)?)
    }

    fn read_back(bytes: &[u8]) -> anyhow::Result<Vec<parquet::record::Row>> {
        Ok(reader(bytes)?
            .get_row_iter(None)?
            .collect::<Result<_, _>>()?)
    }

    fn labels_of(row: &parquet::record::Row) -> anyhow::Result<Vec<String>> {
        row.get_list(10)?
            .elements()
            .iter()
            .map(|f| match f {
                Field::Str(s) => Ok(s.clone()),
                other => anyhow::bail!("label {other:?}"),
            })
            .collect()
    }

    #[test]
    fn parquet_round_trips() -> anyhow::Result<()> {
        let rows = rows();
        let mut out = Vec::new();
        to_parquet(&rows, &mut out)?;
        assert_eq!(&out[..4], b"PAR1");
        assert_eq!(&out[out.len() - 4..], b"PAR1");

        let reader = reader(&out)?;
        let meta = reader.metadata();
        assert_eq!(meta.file_metadata().num_rows(), 3);
        let schema = meta.file_metadata().schema_descr();
        let names: Vec<String> = schema.columns().iter().map(|c| c.path().string()).collect();
        assert_eq!(names[10], "labels.list.element");
        assert_eq!(schema.num_columns(), COLUMNS.len());

        let back = read_back(&out)?;
        assert_eq!(back.len(), rows.len());
        for (r, b) in rows.iter().zip(&back) {
            assert_eq!(b.get_string(0)?, &r.trajectory);
            assert_eq!(b.get_long(1)?, r.step as i64);
            assert_eq!(b.get_string(2)?, &r.action);
            assert_eq!(b.get_string(3)?, &r.observation);
            let fields: Vec<&Field> = b.get_column_iter().map(|(_, f)| f).collect();
            match (&r.exit_status, fields[4]) {
                (Some(s), Field::Str(t)) => assert_eq!(s, t),
                (None, Field::Null) => {}
                (a, b) => panic!("exit_status {a:?} vs {b:?}"),
            }
            for (i, v) in [r.exit_code, r.wall_us, r.started_at_ms, r.finished_at_ms]
                .into_iter()
                .enumerate()
            {
                match (v, fields[5 + i]) {
                    (Some(a), Field::Long(b)) => assert_eq!(a, *b),
                    (None, Field::Null) => {}
                    (a, b) => panic!("column {} {a:?} vs {b:?}", COLUMNS[5 + i]),
                }
            }
            match (r.reward, fields[9]) {
                (Some(a), Field::Double(b)) => assert!(a == *b || (a.is_nan() && b.is_nan())),
                (None, Field::Null) => {}
                (a, b) => panic!("reward {a:?} vs {b:?}"),
            }
            assert_eq!(labels_of(b)?, r.labels);
            let ann = if r.annotations.is_empty() {
                "{}"
            } else {
                &r.annotations
            };
            assert_eq!(b.get_string(11)?, ann);
        }
        Ok(())
    }

    #[test]
    fn parquet_of_nothing_is_a_valid_empty_file() -> anyhow::Result<()> {
        let mut out = Vec::new();
        to_parquet(&[], &mut out)?;
        let reader = reader(&out)?;
        assert_eq!(reader.metadata().file_metadata().num_rows(), 0);
        assert_eq!(reader.metadata().num_row_groups(), 0);
        Ok(())
    }

    #[test]
    fn parquet_splits_large_exports_into_row_groups() -> anyhow::Result<()> {
        // Two groups by row count, with large JSON values crossing page boundaries.
        let big = format!("{{\"out\":\"{}\"}}", "x".repeat(3 << 20));
        let mut rows: Vec<ExportRow> = (0..ROW_GROUP_ROWS as u64 + 5)
            .map(|i| ExportRow {
                trajectory: format!("t{}", i % 3),
                step: i,
                action: "{}".into(),
                observation: "{}".into(),
                labels: (0..i % 3).map(|j| format!("l{j}")).collect(),
                annotations: "{}".into(),
                ..ExportRow::default()
            })
            .collect();
        rows[7].observation = big.clone();
        let mut out = Vec::new();
        to_parquet(&rows, &mut out)?;
        let reader = reader(&out)?;
        assert_eq!(reader.metadata().num_row_groups(), 2);
        let back = read_back(&out)?;
        assert_eq!(back.len(), rows.len());
        assert_eq!(back[7].get_string(3)?, &big);
        for (r, b) in rows.iter().zip(&back).step_by(997) {
            assert_eq!(b.get_long(1)?, r.step as i64);
            assert_eq!(labels_of(b)?, r.labels);
        }
        let last = back.last().context("no rows")?;
        assert_eq!(last.get_long(1)?, ROW_GROUP_ROWS as i64 + 4);
        Ok(())
    }

    #[test]
    fn row_groups_are_bounded_by_bytes() -> anyhow::Result<()> {
        let row = ExportRow {
            observation: "x".repeat(ROW_GROUP_BYTES / 2),
            ..ExportRow::default()
        };
        let rows = vec![row; 5];
        let sizes: Vec<usize> = row_groups(&rows).map(<[ExportRow]>::len).collect();
        assert_eq!(sizes, [2, 2, 1]);
        Ok(())
    }

    /// Cross-check with an independent reader: pyarrow, in the Python of `DSEC_TEST_PYTHON`
    /// (scripts/test.sh points it at the test venv, which has pyarrow) or `python3`. Fails when
    /// that Python has no pyarrow.
    #[test]
    fn parquet_reads_in_pyarrow() -> anyhow::Result<()> {
        let python = std::env::var("DSEC_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let has = std::process::Command::new(&python)
            .args(["-c", "import pyarrow.parquet"])
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            has,
            "{python} cannot import pyarrow: run through scripts/test.sh, or set DSEC_TEST_PYTHON \
             to a Python with pyarrow"
        );
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("t.parquet");
        let mut f = std::fs::File::create(&path)?;
        to_parquet(&rows(), &mut f)?;
        drop(f);
        let script = r#"
import json, sys, pyarrow.parquet as pq
t = pq.read_table(sys.argv[1]).to_pylist()
assert len(t) == 3, t
assert t[0]["trajectory"] == "run-1" and t[0]["step"] == 0
assert json.loads(t[0]["action"])["argv"] == ["ls", "-l"]
assert t[0]["labels"] == ["good", "fast"] and t[1]["labels"] == [] and t[2]["labels"] == ["only"]
assert t[1]["exit_status"] is None and t[1]["reward"] is None and t[0]["reward"] == 0.5
assert json.loads(t[0]["annotations"])["note"] == "ünïcode ✓"
print(pq.read_schema(sys.argv[1]))
"#;
        let o = std::process::Command::new(&python)
            .args(["-c", script])
            .arg(&path)
            .output()?;
        assert!(
            o.status.success(),
            "pyarrow: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        eprintln!("{}", String::from_utf8_lossy(&o.stdout));
        Ok(())
    }
}
