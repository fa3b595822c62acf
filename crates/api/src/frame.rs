//! The frame codec between node and agent.
//!
//! ```text
//! offset 0   2 bytes  magic "DS"
//!        2   1 byte   protocol version (== PROTOCOL_VERSION)
//!        3   1 byte   kind: 0 = request (host → agent), 1 = event (agent → host)
//!        4   4 bytes  header length, little endian, ≤ MAX_HEADER
//!        8   4 bytes  body length, little endian, ≤ MAX_BODY
//!       12   header   JSON: RequestEnvelope or EventEnvelope
//!            body     raw bytes (stdin, file content, output chunk, tar stream)
//! ```
//! The decoder never trusts a length before checking it against the bounds, never allocates more
//! than the bounds allow, and reports every malformed input as a [`FrameError`].

use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::agent::{Event, EventEnvelope, Request, RequestEnvelope, PROTOCOL_VERSION};

/// Frame magic.
pub const MAGIC: [u8; 2] = *b"DS";
/// Size of the fixed prefix.
pub const PREFIX_LEN: usize = 12;
/// Largest JSON header accepted.
pub const MAX_HEADER: usize = 4 << 20;
/// Largest body accepted.
pub const MAX_BODY: usize = 32 << 20;

/// Direction of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Host → agent.
    Request,
    /// Agent → host.
    Event,
}

impl FrameKind {
    fn to_byte(self) -> u8 {
        match self {
            FrameKind::Request => 0,
            FrameKind::Event => 1,
        }
    }

    fn from_byte(b: u8) -> Result<Self, FrameError> {
        match b {
            0 => Ok(FrameKind::Request),
            1 => Ok(FrameKind::Event),
            other => Err(FrameError::BadKind(other)),
        }
    }
}

/// Everything that can go wrong encoding or decoding a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The first two bytes are not the magic.
    #[error("bad frame magic {0:02x?}")]
    BadMagic([u8; 2]),
    /// The peer speaks another protocol version.
    #[error("unsupported protocol version {0}")]
    UnsupportedVersion(u8),
    /// The kind byte is neither request nor event.
    #[error("bad frame kind {0}")]
    BadKind(u8),
    /// A frame of the wrong direction arrived.
    #[error("unexpected frame kind {0:?}")]
    UnexpectedKind(FrameKind),
    /// The header length exceeds [`MAX_HEADER`].
    #[error("frame header of {0} bytes exceeds the limit")]
    HeaderTooLarge(usize),
    /// The body length exceeds [`MAX_BODY`].
    #[error("frame body of {0} bytes exceeds the limit")]
    BodyTooLarge(usize),
    /// The header is not a valid message.
    #[error("malformed frame header")]
    BadHeader(#[source] serde_json::Error),
    /// Serializing a message failed.
    #[error("encode frame header")]
    Encode(#[source] serde_json::Error),
    /// The stream ended in the middle of a frame.
    #[error("stream ended inside a frame")]
    Truncated,
    /// Reading or writing the transport failed.
    #[error("frame transport")]
    Io(#[source] io::Error),
}

/// A frame whose header has not been parsed yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawFrame {
    /// Direction.
    pub kind: FrameKind,
    /// JSON header bytes.
    pub header: Vec<u8>,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl RawFrame {
    /// Parses the header as a request.
    pub fn into_request(self) -> Result<(RequestEnvelope, Vec<u8>), FrameError> {
        if self.kind != FrameKind::Request {
            return Err(FrameError::UnexpectedKind(self.kind));
        }
        Ok((parse(&self.header)?, self.body))
    }

    /// Parses the header as an event.
    pub fn into_event(self) -> Result<(EventEnvelope, Vec<u8>), FrameError> {
        if self.kind != FrameKind::Event {
            return Err(FrameError::UnexpectedKind(self.kind));
        }
        Ok((parse(&self.header)?, self.body))
    }
}

fn parse<T: DeserializeOwned>(header: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(header).map_err(FrameError::BadHeader)
}

fn encode<T: Serialize>(kind: FrameKind, msg: &T, body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let header = serde_json::to_vec(msg).map_err(FrameError::Encode)?;
    if header.len() > MAX_HEADER {
        return Err(FrameError::HeaderTooLarge(header.len()));
    }
    if body.len() > MAX_BODY {
        return Err(FrameError::BodyTooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(PREFIX_LEN + header.len() + body.len());
    out.extend_from_slice(&MAGIC);
    out.push(PROTOCOL_VERSION);
    out.push(kind.to_byte());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(body);
    Ok(out)
}

/// Encodes a request frame.
pub fn encode_request(id: u64, req: &Request, body: &[u8]) -> Result<Vec<u8>, FrameError> {
    encode(
        FrameKind::Request,
        &RequestEnvelope {
            id,
            req: req.clone(),
        },
        body,
    )
}

/// Encodes an event frame.
pub fn encode_event(id: u64, ev: &Event, body: &[u8]) -> Result<Vec<u8>, FrameError> {
    encode(
        FrameKind::Event,
        &EventEnvelope { id, ev: ev.clone() },
        body,
    )
}

/// Parsed prefix: (kind, header length, body length).
fn parse_prefix(p: &[u8; PREFIX_LEN]) -> Result<(FrameKind, usize, usize), FrameError> {
    let magic = [p[0], p[1]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    if p[2] != PROTOCOL_VERSION {
        return Err(FrameError::UnsupportedVersion(p[2]));
    }
    let kind = FrameKind::from_byte(p[3])?;
    let hlen = u32::from_le_bytes([p[4], p[5], p[6], p[7]]) as usize;
    let blen = u32::from_le_bytes([p[8], p[9], p[10], p[11]]) as usize;
    if hlen > MAX_HEADER {
        return Err(FrameError::HeaderTooLarge(hlen));
    }
    if blen > MAX_BODY {
        return Err(FrameError::BodyTooLarge(blen));
    }
    Ok((kind, hlen, blen))
}

/// Buffer capacity a [`FrameDecoder`] keeps once it has returned everything it held.
const KEEP_CAPACITY: usize = 64 << 10;

/// Incremental decoder for byte streams that arrive in arbitrary pieces.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
}

impl FrameDecoder {
    /// A decoder with an empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes buffered but not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Returns the next complete frame, `Ok(None)` when more bytes are needed. After an error
    /// the stream is unusable (framing is lost) and the caller must drop the connection.
    pub fn next_frame(&mut self) -> Result<Option<RawFrame>, FrameError> {
        if self.buf.len() < PREFIX_LEN {
            return Ok(None);
        }
        let mut prefix = [0u8; PREFIX_LEN];
        prefix.copy_from_slice(&self.buf[..PREFIX_LEN]);
        let (kind, hlen, blen) = parse_prefix(&prefix)?;
        let total = PREFIX_LEN + hlen + blen;
        if self.buf.len() < total {
            return Ok(None);
        }
        let header = self.buf[PREFIX_LEN..PREFIX_LEN + hlen].to_vec();
        let body = self.buf[PREFIX_LEN + hlen..total].to_vec();
        self.buf.drain(..total);
        if self.buf.is_empty() && self.buf.capacity() > KEEP_CAPACITY {
            // One large frame must not pin its size for the connection's lifetime: a node
            // holds thousands of connections, and any agent can send a frame of the maximum.
            self.buf = Vec::new();
        }
        Ok(Some(RawFrame { kind, header, body }))
    }
}

/// Reads one frame from a blocking reader. `Ok(None)` on a clean end of stream between frames.
pub fn read_frame<R: Read>(r: &mut R) -> Result<Option<RawFrame>, FrameError> {
    let mut prefix = [0u8; PREFIX_LEN];
    let mut got = 0;
    while got < PREFIX_LEN {
        match r.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let (kind, hlen, blen) = parse_prefix(&prefix)?;
    let header = read_len(r, hlen)?;
    let body = read_len(r, blen)?;
    Ok(Some(RawFrame { kind, header, body }))
}

/// Reads exactly `len` bytes, growing the buffer as bytes arrive: a peer that announces a large
/// frame and sends little makes the reader allocate only what it sent.
fn read_len<R: Read>(r: &mut R, len: usize) -> Result<Vec<u8>, FrameError> {
    let mut buf = Vec::with_capacity(len.min(64 << 10));
    r.take(len as u64)
        .read_to_end(&mut buf)
        .map_err(FrameError::Io)?;
    if buf.len() < len {
        return Err(FrameError::Truncated);
    }
    Ok(buf)
}

/// Writes an encoded frame to a blocking writer.
pub fn write_all<W: Write>(w: &mut W, frame: &[u8]) -> Result<(), FrameError> {
    w.write_all(frame).map_err(FrameError::Io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::ExecRequest;
    use proptest::prelude::*;

    #[test]
    fn roundtrip_request_in_pieces() {
        let req = Request::Exec(ExecRequest::argv(["/bin/true"]));
        let bytes = encode_request(42, &req, b"stdin").expect("encode");
        let mut dec = FrameDecoder::new();
        for b in &bytes {
            dec.push(std::slice::from_ref(b));
        }
        let frame = dec.next_frame().expect("decode").expect("complete");
        let (env, body) = frame.into_request().expect("request");
        assert_eq!(env.id, 42);
        assert_eq!(env.req, req);
        assert_eq!(body, b"stdin");
        assert_eq!(dec.buffered(), 0);
    }

    #[test]
    fn a_large_frame_does_not_pin_its_buffer() {
        let req = Request::Exec(ExecRequest::argv(["/bin/true"]));
        let big = encode_request(1, &req, &vec![7u8; 1 << 20]).expect("encode");
        let small = encode_request(2, &req, b"x").expect("encode");
        let mut dec = FrameDecoder::new();
        dec.push(&big);
        assert_eq!(
            dec.next_frame().expect("decode").expect("frame").body.len(),
            1 << 20
        );
        assert!(
            dec.buf.capacity() <= KEEP_CAPACITY,
            "{}",
            dec.buf.capacity()
        );
        // A partly consumed buffer is kept as it is (the rest of a frame follows).
        dec.push(&small);
        dec.push(&big[..100]);
        assert_eq!(dec.next_frame().expect("decode").expect("frame").body, b"x");
        assert_eq!(dec.buffered(), 100);
    }

    #[test]
    fn rejects_oversized_lengths_before_allocating() {
        let mut bad = Vec::from(MAGIC);
        bad.extend_from_slice(&[PROTOCOL_VERSION, 0]);
        bad.extend_from_slice(&u32::MAX.to_le_bytes());
        bad.extend_from_slice(&0u32.to_le_bytes());
        let mut dec = FrameDecoder::new();
        dec.push(&bad);
        assert!(matches!(
            dec.next_frame(),
            Err(FrameError::HeaderTooLarge(_))
        ));
        assert!(matches!(
            read_frame(&mut &bad[..]),
            Err(FrameError::HeaderTooLarge(_))
        ));
    }

    #[test]
    fn rejects_other_versions_and_truncation() {
        let mut bytes = encode_event(1, &Event::Pong, b"").expect("encode");
        let cut = bytes[..bytes.len() - 1].to_vec();
        assert!(matches!(
            read_frame(&mut &cut[..]),
            Err(FrameError::Truncated)
        ));
        bytes[2] = 99;
        assert!(matches!(
            read_frame(&mut &bytes[..]),
            Err(FrameError::UnsupportedVersion(99))
        ));
    }

    proptest! {
        /// Arbitrary bytes never panic the decoder and never yield a frame that violates bounds.
        #[test]
        fn decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let mut dec = FrameDecoder::new();
            dec.push(&data);
            while let Ok(Some(frame)) = dec.next_frame() {
                prop_assert!(frame.header.len() <= MAX_HEADER);
                prop_assert!(frame.body.len() <= MAX_BODY);
                let _ = frame.clone().into_request();
                let _ = frame.into_event();
            }
            let _ = read_frame(&mut &data[..]);
        }

        /// Valid frames with a corrupted byte either decode to some frame or fail cleanly.
        #[test]
        fn bitflips_fail_cleanly(pos in 0usize..64, bit in 0u8..8, id in 1u64..1000) {
            let mut bytes = encode_request(id, &Request::Ping, b"xyz").expect("encode");
            let i = pos % bytes.len();
            bytes[i] ^= 1 << bit;
            if let Ok(Some(frame)) = read_frame(&mut &bytes[..]) {
                let _ = frame.into_request();
            }
        }
    }
}
