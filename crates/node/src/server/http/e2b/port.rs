//! A port of the sandbox (`E2b-Sandbox-Port` other than the sandbox API's and the code
//! interpreter's, or `Host: <port>-<id>.<domain>`): the HTTP request is forwarded to
//! `127.0.0.1:<port>` inside the sandbox's own network namespace, so a web server the
//! sandbox runs is reachable through the node. HTTP/1.1, one connection per request
//! (`Connection: close`); the answer streams back (a chunked one decoded and re-chunked).

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use super::*;

/// Longest wait for the sandbox's server to accept.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest response head accepted.
const MAX_HEAD: usize = 64 << 10;
/// Headers not forwarded: hop-by-hop ones and this API's own.
const DROPPED: [&str; 12] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-connection",
    "content-length",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
    "x-access-token",
];

fn unreachable_port(id: &str, port: u16, why: impl std::fmt::Display) -> Response {
    e2b_error(
        StatusCode::BAD_GATEWAY,
        format!("The sandbox {id} is running but port {port} is not open ({why})"),
    )
}

/// Forwards `req` to `port` of the target sandbox.
pub(super) async fn serve(t: Target, port: u16, req: Request) -> Response {
    let id = t.id().to_owned();
    if t.entry.record().spec.substrate.is_vm() {
        return unreachable_port(&id, port, "ports of VM sandboxes are not forwarded yet");
    }
    let init = match with_sandbox(&t.app, &t.entry, |_, sb| Ok(sb.init_pid())).await {
        Ok(pid) => pid,
        Err(e) => return e2b_error(ApiError::status_of(e.code), e.detail),
    };
    let connected = tokio::task::spawn_blocking(move || {
        dsec_sys::net::connect_in_netns(init, port, CONNECT_TIMEOUT)
    })
    .await;
    let stream = match connected {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return unreachable_port(&id, port, e),
        Err(e) => return unreachable_port(&id, port, e),
    };
    let stream = match stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::TcpStream::from_std(stream))
    {
        Ok(s) => s,
        Err(e) => return unreachable_port(&id, port, e),
    };
    match forward(stream, port, req).await {
        Ok(r) => r,
        Err(e) => unreachable_port(&id, port, e),
    }
}

async fn forward(
    mut stream: tokio::net::TcpStream,
    port: u16,
    req: Request,
) -> std::io::Result<Response> {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, MAX_BODY)
        .await
        .map_err(std::io::Error::other)?;
    let target = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let mut head = format!("{} {target} HTTP/1.1\r\n", parts.method);
    let mut has_host = false;
    for (k, v) in &parts.headers {
        let name = k.as_str();
        if DROPPED.contains(&name) {
            continue;
        }
        let Ok(v) = v.to_str() else { continue };
        if name == "host" {
            has_host = true;
            head.push_str(&format!("host: 127.0.0.1:{port}\r\n"));
            continue;
        }
        head.push_str(&format!("{name}: {v}\r\n"));
    }
    if !has_host {
        head.push_str(&format!("host: 127.0.0.1:{port}\r\n"));
    }
    head.push_str(&format!(
        "connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    ));
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(&body).await?;
    let mut r = BufReader::new(stream);
    let (status, headers) = read_head(&mut r).await?;
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked")
    });
    let length: Option<u64> = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok());
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(8);
    tokio::spawn(async move {
        let _ = if chunked {
            pump_chunked(&mut r, &tx).await
        } else {
            pump_plain(&mut r, length, &tx).await
        };
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    for (k, v) in headers {
        let lower = k.to_ascii_lowercase();
        if DROPPED.contains(&lower.as_str()) && lower != "content-length" {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(&v),
        ) {
            resp.headers_mut().append(name, value);
        }
    }
    Ok(resp)
}

/// The status and headers of a response.
async fn read_head(
    r: &mut BufReader<tokio::net::TcpStream>,
) -> std::io::Result<(u16, Vec<(String, String)>)> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_owned());
    let mut total = 0;
    let mut line = String::new();
    r.read_line(&mut line).await?;
    total += line.len();
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .filter(|s| (100..1000).contains(s))
        .ok_or_else(|| bad("the sandbox's server answered no HTTP status line"))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Err(bad("the response head ended early"));
        }
        total += line.len();
        if total > MAX_HEAD {
            return Err(bad("the response head is too large"));
        }
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            return Ok((status, headers));
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
}

async fn pump_plain(
    r: &mut BufReader<tokio::net::TcpStream>,
    length: Option<u64>,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
) -> std::io::Result<()> {
    let mut left = length.unwrap_or(u64::MAX);
    let mut buf = vec![0u8; 64 << 10];
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = r.read(&mut buf[..want]).await?;
        if n == 0 {
            break;
        }
        left -= n as u64;
        if tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
            break;
        }
    }
    Ok(())
}

async fn pump_chunked(
    r: &mut BufReader<tokio::net::TcpStream>,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
) -> std::io::Result<()> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad chunk");
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 || line.len() > 1024 {
            return Err(bad());
        }
        let size_hex = line.trim().split(';').next().unwrap_or("");
        let size = u64::from_str_radix(size_hex, 16).map_err(|_| bad())?;
        if size == 0 {
            return Ok(()); // trailers, if any, are dropped
        }
        let mut left = size;
        let mut buf = vec![0u8; 64 << 10];
        while left > 0 {
            let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = r.read(&mut buf[..want]).await?;
            if n == 0 {
                return Err(bad());
            }
            left -= n as u64;
            if tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                return Ok(());
            }
        }
        line.clear();
        r.read_line(&mut line).await?;
    }
}
