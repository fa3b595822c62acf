//! A cluster's origin store in an S3-compatible bucket (`--template-store s3://bucket/prefix`):
//! layer blobs under `<prefix>/blobs/<sha256>`, read and written with AWS Signature Version 4
//! over path-style URLs (`<endpoint>/<bucket>/<key>`), so any S3 implementation serves.
//!
//! Settings come from the usual AWS variables: `AWS_ENDPOINT_URL` (default
//! `https://s3.<region>.amazonaws.com`), `AWS_REGION` (default `us-east-1`),
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and, for temporary credentials,
//! `AWS_SESSION_TOKEN`. A blob's payload hash is its digest (a layer's digest is the sha256 of
//! its blob), so uploads are signed over their content without reading them twice.

use std::io::Read;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest as _, Sha256};

/// The sha256 of an empty payload.
const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// A bucket and a key prefix, and how to reach and sign for it.
#[derive(Debug, Clone)]
pub struct S3 {
    endpoint: String,
    bucket: String,
    prefix: String,
    region: String,
    access_key: String,
    secret_key: String,
    token: Option<String>,
}

impl S3 {
    /// The store `url` names (`s3://bucket[/prefix]`), with the AWS variables' settings.
    pub fn from_url(url: &str) -> Result<Self, String> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| format!("{url}: not an s3:// URL"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(format!("{url}: no bucket"));
        }
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let region = env("AWS_REGION").unwrap_or_else(|| "us-east-1".into());
        Ok(Self {
            endpoint: env("AWS_ENDPOINT_URL")
                .unwrap_or_else(|| format!("https://s3.{region}.amazonaws.com"))
                .trim_end_matches('/')
                .to_owned(),
            bucket: bucket.to_owned(),
            prefix: prefix.trim_matches('/').to_owned(),
            region,
            access_key: env("AWS_ACCESS_KEY_ID").unwrap_or_default(),
            secret_key: env("AWS_SECRET_ACCESS_KEY").unwrap_or_default(),
            token: env("AWS_SESSION_TOKEN"),
        })
    }

    fn path(&self, hex: &str) -> String {
        match self.prefix.as_str() {
            "" => format!("/{}/blobs/{hex}", self.bucket),
            p => format!("/{}/{p}/blobs/{hex}", self.bucket),
        }
    }

    /// The signed headers of a request (`Authorization` and the `x-amz-*` it signs).
    fn signed(&self, method: &str, path: &str, payload_sha256: &str) -> Vec<(String, String)> {
        let host = self
            .endpoint
            .split_once("://")
            .map_or(self.endpoint.as_str(), |(_, h)| h)
            .split('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let mut headers = vec![
            ("host".to_owned(), host),
            ("x-amz-content-sha256".to_owned(), payload_sha256.to_owned()),
            ("x-amz-date".to_owned(), amz_date(now_secs())),
        ];
        if let Some(t) = &self.token {
            headers.push(("x-amz-security-token".to_owned(), t.clone()));
        }
        let auth = authorization(
            &Signer {
                access_key: &self.access_key,
                secret_key: &self.secret_key,
                region: &self.region,
            },
            method,
            path,
            &headers,
            payload_sha256,
        );
        headers.retain(|(k, _)| k != "host");
        headers.push(("authorization".to_owned(), auth));
        headers
    }

    /// Uploads the blob at `src` whose sha256 is `hex` (nothing when the object is there).
    pub fn put(&self, agent: &ureq::Agent, hex: &str, src: &Path) -> Result<(), String> {
        let path = self.path(hex);
        let url = format!("{}{path}", self.endpoint);
        let mut head = agent.head(&url);
        for (k, v) in self.signed("HEAD", &path, EMPTY_SHA256) {
            head = head.header(k, v);
        }
        if head.call().is_ok() {
            return Ok(());
        }
        let file = std::fs::File::open(src).map_err(|e| format!("{}: {e}", src.display()))?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut put = agent
            .put(&url)
            .header("content-length", len.to_string())
            .header("content-type", "application/x-tar");
        for (k, v) in self.signed("PUT", &path, hex) {
            put = put.header(k, v);
        }
        put.send(ureq::SendBody::from_reader(&mut std::io::BufReader::new(
            file,
        )))
        .map(|_| ())
        .map_err(|e| format!("PUT {url}: {e}"))
    }

    /// Reads the blob whose sha256 is `hex`.
    pub fn open(&self, agent: &ureq::Agent, hex: &str) -> Result<Box<dyn Read + Send>, String> {
        let path = self.path(hex);
        let url = format!("{}{path}", self.endpoint);
        let mut get = agent.get(&url);
        for (k, v) in self.signed("GET", &path, EMPTY_SHA256) {
            get = get.header(k, v);
        }
        let r = get.call().map_err(|e| format!("GET {url}: {e}"))?;
        Ok(Box::new(r.into_body().into_reader()))
    }
}

/// Who signs, where.
struct Signer<'a> {
    access_key: &'a str,
    secret_key: &'a str,
    region: &'a str,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `YYYYMMDDTHHMMSSZ` of `secs` since the epoch (UTC).
fn amz_date(secs: u64) -> String {
    let (y, m, d, hh, mm, ss) = crate::clock::civil(secs);
    format!("{y:04}{m:02}{d:02}T{hh:02}{mm:02}{ss:02}Z")
}

fn hmac(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let (mut inner, mut outer) = (Sha256::new(), Sha256::new());
    inner.update(k.map(|b| b ^ 0x36));
    inner.update(msg);
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// The `Authorization` header of a request with no query string, signing `headers` (lowercase
/// names; `host` and `x-amz-date` among them).
fn authorization(
    s: &Signer<'_>,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    payload_sha256: &str,
) -> String {
    let mut sorted: Vec<&(String, String)> = headers.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let canonical_headers: String = sorted
        .iter()
        .map(|(k, v)| format!("{k}:{}\n", v.trim()))
        .collect();
    let signed_headers = sorted
        .iter()
        .map(|(k, _)| k.as_str())
        .collect::<Vec<_>>()
        .join(";");
    let canonical =
        format!("{method}\n{path}\n\n{canonical_headers}\n{signed_headers}\n{payload_sha256}");
    let date = headers
        .iter()
        .find(|(k, _)| k == "x-amz-date")
        .map_or("", |(_, v)| v.as_str());
    let day = &date[..date.len().min(8)];
    let scope = format!("{day}/{}/s3/aws4_request", s.region);
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{date}\n{scope}\n{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let mut key = hmac(format!("AWS4{}", s.secret_key).as_bytes(), day.as_bytes());
    for part in [s.region, "s3", "aws4_request"] {
        key = hmac(&key, part.as_bytes());
    }
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed_headers}, Signature={}",
        s.access_key,
        hex::encode(hmac(&key, to_sign.as_bytes()))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AWS's own example of a signed request ("Signature Calculations for the Authorization
    /// Header", GET Object): the signature must be theirs.
    #[test]
    fn signs_the_aws_documentation_example() {
        let s = Signer {
            access_key: "AKIAIOSFODNN7EXAMPLE",
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            region: "us-east-1",
        };
        let headers: Vec<(String, String)> = [
            ("host", "examplebucket.s3.amazonaws.com"),
            ("range", "bytes=0-9"),
            ("x-amz-content-sha256", EMPTY_SHA256),
            ("x-amz-date", "20130524T000000Z"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        let auth = authorization(&s, "GET", "/test.txt", &headers, EMPTY_SHA256);
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, \
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
    }

    #[test]
    fn dates_and_urls() {
        assert_eq!(amz_date(1_369_353_600), "20130524T000000Z");
        assert_eq!(amz_date(0), "19700101T000000Z");
        assert!(S3::from_url("s3://").is_err());
        assert!(S3::from_url("/srv/x").is_err());
        let s = S3::from_url("s3://b/some/prefix/").expect("a url");
        assert_eq!(s.path("ab"), "/b/some/prefix/blobs/ab");
        let s = S3::from_url("s3://b").expect("a url");
        assert_eq!(s.path("ab"), "/b/blobs/ab");
    }
}
