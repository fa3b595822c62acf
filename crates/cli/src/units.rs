//! Parsing of human units on the command line.

/// Parses `512`, `64K`, `256M`, `1G`, `1.5G` (binary multiples) into bytes.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = s[i..].to_ascii_uppercase();
            let mult: u64 = match unit.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1 << 40,
                _ => return Err(format!("unknown size unit in {s:?} (use K, M, G or T)")),
            };
            (&s[..i], mult)
        }
        None => (s, 1),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?} (e.g. 256M, 1G)"))?;
    if !n.is_finite() || n < 0.0 {
        return Err(format!("invalid size {s:?}"));
    }
    Ok((n * mult as f64) as u64)
}

/// Parses `250ms`, `10s`, `2m`, `1h` or a bare number of seconds into milliseconds.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?} (e.g. 500ms, 10s, 2m)"))?;
    let ms = match unit {
        "ms" => n,
        "" | "s" => n * 1e3,
        "m" => n * 60e3,
        "h" => n * 3600e3,
        _ => {
            return Err(format!(
                "unknown duration unit in {s:?} (use ms, s, m or h)"
            ))
        }
    };
    if !ms.is_finite() || ms < 1.0 {
        return Err(format!("duration {s:?} must be at least 1ms"));
    }
    Ok(ms as u64)
}

/// Parses `KEY=VALUE`.
pub fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!(
            "invalid environment entry {s:?} (expected KEY=VALUE)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("256M"), Ok(256 << 20));
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        assert_eq!(parse_bytes("1gib"), Ok(1 << 30));
        assert_eq!(parse_bytes("512"), Ok(512));
        assert!(parse_bytes("12Q").is_err());
        assert!(parse_bytes("-1M").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ms("500ms"), Ok(500));
        assert_eq!(parse_duration_ms("10s"), Ok(10_000));
        assert_eq!(parse_duration_ms("2m"), Ok(120_000));
        assert_eq!(parse_duration_ms("3"), Ok(3000));
        assert!(parse_duration_ms("0s").is_err());
        assert!(parse_duration_ms("10x").is_err());
    }

    #[test]
    fn env() {
        assert_eq!(parse_env("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert!(parse_env("=x").is_err());
        assert!(parse_env("noequals").is_err());
    }
}
