//! A `multipart/form-data` body (RFC 7578), parsed from memory: the SDK's file uploads. The
//! body is bounded by the router's limit; parts are at most [`MAX_PARTS`].

use axum::body::Bytes;

/// Most parts accepted.
pub(super) const MAX_PARTS: usize = 1024;
/// Most bytes of one part's headers.
const MAX_HEADERS: usize = 16 << 10;

/// One part.
#[derive(Debug)]
pub(super) struct Part {
    /// `name` of its `Content-Disposition`.
    pub(super) name: String,
    /// `filename` of its `Content-Disposition`, when given.
    pub(super) filename: Option<String>,
    /// Its content.
    pub(super) data: Bytes,
}

/// The boundary of a `multipart/form-data` content type.
fn boundary(content_type: &str) -> Option<String> {
    content_type.split(';').skip(1).find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"').to_owned())
    })
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || from > hay.len() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

/// A `key="value"` parameter of a header value (quotes optional; `\"` unescaped).
fn param(header: &str, key: &str) -> Option<String> {
    let mut rest = header;
    while let Some(i) = rest.find(';') {
        rest = rest[i + 1..].trim_start();
        let Some((k, v)) = rest.split_once('=') else {
            break;
        };
        if k.trim().eq_ignore_ascii_case(key) {
            let v = v.trim_start();
            if let Some(q) = v.strip_prefix('"') {
                let mut out = String::new();
                let mut chars = q.chars();
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => out.extend(chars.next()),
                        '"' => return Some(out),
                        c => out.push(c),
                    }
                }
                return None;
            }
            return Some(v.split(';').next().unwrap_or("").trim().to_owned());
        }
    }
    None
}

/// Parses `body`; a message naming what is wrong otherwise.
pub(super) fn parse(content_type: &str, body: &Bytes) -> Result<Vec<Part>, String> {
    let b = boundary(content_type).ok_or("multipart body without a boundary")?;
    if b.is_empty() || b.len() > 200 {
        return Err("bad multipart boundary".into());
    }
    let delim = format!("--{b}");
    let next_delim = format!("\r\n--{b}");
    let mut pos =
        find(body, delim.as_bytes(), 0).ok_or("no multipart boundary in the body")? + delim.len();
    let mut parts = Vec::new();
    loop {
        // After a boundary: `--` ends the body, CRLF starts a part.
        if body[pos..].starts_with(b"--") {
            return Ok(parts);
        }
        if !body[pos..].starts_with(b"\r\n") {
            return Err("malformed multipart boundary line".into());
        }
        pos += 2;
        let head_end = find(body, b"\r\n\r\n", pos).ok_or("multipart part without headers' end")?;
        if head_end - pos > MAX_HEADERS {
            return Err("multipart part headers too long".into());
        }
        let head = String::from_utf8_lossy(&body[pos..head_end]);
        let mut name = None;
        let mut filename = None;
        for line in head.split("\r\n") {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            if k.trim().eq_ignore_ascii_case("content-disposition") {
                name = param(v, "name");
                filename = param(v, "filename");
            }
        }
        let data_start = head_end + 4;
        let data_end =
            find(body, next_delim.as_bytes(), data_start).ok_or("multipart part not terminated")?;
        if parts.len() >= MAX_PARTS {
            return Err(format!("more than {MAX_PARTS} multipart parts"));
        }
        parts.push(Part {
            name: name.unwrap_or_default(),
            filename,
            data: body.slice(data_start..data_end),
        });
        pos = data_end + next_delim.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_sdks_upload() {
        let body = Bytes::from_static(
            b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/a b.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/c\"\r\n\r\n\r\n--x\r\n--xyz--\r\n",
        );
        let parts = parse("multipart/form-data; boundary=xyz", &body).expect("parse");
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "file");
        assert_eq!(parts[0].filename.as_deref(), Some("/tmp/a b.txt"));
        assert_eq!(&parts[0].data[..], b"hello");
        assert_eq!(&parts[1].data[..], b"\r\n--x");
    }

    #[test]
    fn refuses_malformed_bodies() {
        for body in [
            &b""[..],
            b"--xyz",
            b"--xyz\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nunterminated",
            b"--xyz\r\nno headers end",
            b"--xyzjunk",
        ] {
            let r = parse(
                "multipart/form-data; boundary=xyz",
                &Bytes::copy_from_slice(body),
            );
            assert!(r.is_err(), "{body:?}");
        }
        assert!(parse("multipart/form-data", &Bytes::new()).is_err());
    }
}
