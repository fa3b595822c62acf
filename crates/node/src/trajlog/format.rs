//! The on-disk record frame and segment file names.
//!
//! A segment is a sequence of frames with nothing between them:
//!
//! ```text
//! offset size field
//!      0    4 magic        0x474C_5344 ("DSLG" little-endian)
//!      4    4 len          bytes after the crc field (body), ≤ MAX_BODY
//!      8    4 crc          CRC-32 (IEEE) of bytes 0..8 followed by the body
//!     12    8 lsn          global sequence number, gaps only in compacted segments
//!     20    8 step         the trajectory's step
//!     28    1 kind         1 intent, 2 result, 3 annotation
//!     29    1 traj_len     1..=128
//!     30    n trajectory   traj_len bytes of ASCII
//!   30+n    m payload      the rest of the body (len - 18 - n bytes)
//! ```
//!
//! All integers are little-endian. The CRC covers the magic and the length, so a frame whose length
//! field is damaged fails its CRC rather than being read with another length.
//!
//! A segment rewritten by compaction starts with a segment header before its frames; a segment
//! without one (its first bytes are a frame's magic, or it is empty) is an original segment:
//!
//! ```text
//! offset size field
//!      0    4 magic        0x434C_5344 ("DSLC" little-endian)
//!      4    4 crc          CRC-32 (IEEE) of bytes 0..4 followed by bytes 8..24
//!      8    8 first        the first lsn the segment was created with (its file name)
//!     16    8 end          one past the last lsn it ever held: the next segment's first lsn
//! ```
//!
//! Its frames have increasing lsns in `first..end`, with gaps where records were dropped.

use super::{Lsn, RecordKind, MAX_PAYLOAD, MAX_TRAJECTORY_LEN};

/// The first four bytes of every frame.
pub const MAGIC: u32 = 0x474C_5344;
/// Bytes before the body: magic, len, crc.
pub const HEADER_LEN: usize = 12;
/// Fixed part of the body: lsn, step, kind, traj_len.
pub const BODY_FIXED: usize = 18;
/// The largest body a valid frame can have.
pub const MAX_BODY: usize = BODY_FIXED + MAX_TRAJECTORY_LEN + MAX_PAYLOAD;

/// The first four bytes of a compacted segment.
pub const SEGMENT_MAGIC: u32 = 0x434C_5344;
/// The size of a compacted segment's header.
pub const SEGMENT_HEADER_LEN: usize = 24;

/// The header of a compacted segment: the lsn range `first..end` it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// The first lsn the segment was created with (its file name).
    pub first: Lsn,
    /// One past the last lsn it ever held: the next segment's first lsn.
    pub end: Lsn,
}

/// Appends a compacted segment's header to `out`.
pub fn encode_segment_header(out: &mut Vec<u8>, header: SegmentHeader) {
    let magic = SEGMENT_MAGIC.to_le_bytes();
    let mut rest = [0u8; 16];
    rest[..8].copy_from_slice(&header.first.0.to_le_bytes());
    rest[8..].copy_from_slice(&header.end.0.to_le_bytes());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&crc_of(&magic, &rest).to_le_bytes());
    out.extend_from_slice(&rest);
}

/// Reads the segment header at the start of a segment's bytes: `Ok(None)` for an original
/// segment (no header magic), `Ok(Some(_))` for a compacted one, an error for a damaged header.
pub fn decode_segment_header(data: &[u8]) -> Result<Option<SegmentHeader>, FrameDefect> {
    if data.get(..4) != Some(&SEGMENT_MAGIC.to_le_bytes()[..]) {
        return Ok(None);
    }
    let raw = data.get(..SEGMENT_HEADER_LEN).ok_or(FrameDefect::Short)?;
    let u64_at = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&raw[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let crc = u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]);
    if crc_of(&raw[..4], &raw[8..]) != crc {
        return Err(FrameDefect::Crc);
    }
    let header = SegmentHeader {
        first: Lsn(u64_at(8)),
        end: Lsn(u64_at(16)),
    };
    if header.end <= header.first {
        return Err(FrameDefect::Fields);
    }
    Ok(Some(header))
}

/// The encoded size of a record with this trajectory and payload.
pub fn frame_len(trajectory_len: usize, payload_len: usize) -> usize {
    HEADER_LEN + BODY_FIXED + trajectory_len + payload_len
}

/// Appends one frame to `out`. The caller has validated the trajectory and payload sizes.
pub fn encode(
    out: &mut Vec<u8>,
    lsn: Lsn,
    trajectory: &str,
    step: u64,
    kind: RecordKind,
    payload: &[u8],
) {
    let body_len = BODY_FIXED + trajectory.len() + payload.len();
    debug_assert!(body_len <= MAX_BODY);
    let start = out.len();
    out.reserve(HEADER_LEN + body_len);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&lsn.0.to_le_bytes());
    out.extend_from_slice(&step.to_le_bytes());
    out.push(kind.to_byte());
    out.push(trajectory.len() as u8);
    out.extend_from_slice(trajectory.as_bytes());
    out.extend_from_slice(payload);
    let crc = crc_of(&out[start..start + 8], &out[start + HEADER_LEN..]);
    out[start + 8..start + 12].copy_from_slice(&crc.to_le_bytes());
}

fn crc_of(head: &[u8], body: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(head);
    h.update(body);
    h.finalize()
}

/// A frame's header, checked for magic and length only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Body length.
    pub len: u32,
    /// The stored CRC.
    pub crc: u32,
    raw: [u8; 8],
}

impl Header {
    /// Total frame length.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.len as usize
    }
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameDefect {
    /// Fewer bytes than the header or the announced body.
    Short,
    /// The magic is wrong.
    Magic,
    /// The length is outside `BODY_FIXED..=MAX_BODY`.
    Length,
    /// The CRC does not match.
    Crc,
    /// The body's fields are inconsistent (kind, trajectory length or bytes).
    Fields,
}

impl FrameDefect {
    /// A short stable name for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            FrameDefect::Short => "short",
            FrameDefect::Magic => "magic",
            FrameDefect::Length => "length",
            FrameDefect::Crc => "crc",
            FrameDefect::Fields => "fields",
        }
    }
}

/// Parses and checks a header from the first `HEADER_LEN` bytes of `buf`.
pub fn decode_header(buf: &[u8]) -> Result<Header, FrameDefect> {
    let raw: [u8; HEADER_LEN] = buf
        .get(..HEADER_LEN)
        .and_then(|b| b.try_into().ok())
        .ok_or(FrameDefect::Short)?;
    let magic = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
    if magic != MAGIC {
        return Err(FrameDefect::Magic);
    }
    let len = u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]);
    if (len as usize) < BODY_FIXED || len as usize > MAX_BODY {
        return Err(FrameDefect::Length);
    }
    let crc = u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]);
    let mut head = [0u8; 8];
    head.copy_from_slice(&raw[..8]);
    Ok(Header {
        len,
        crc,
        raw: head,
    })
}

/// A decoded body, borrowing from the frame bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Body<'a> {
    /// Sequence number.
    pub lsn: Lsn,
    /// Step.
    pub step: u64,
    /// Kind.
    pub kind: RecordKind,
    /// Trajectory id.
    pub trajectory: &'a str,
    /// Payload.
    pub payload: &'a [u8],
}

/// Checks the CRC of `body` (exactly `header.len` bytes) and decodes its fields.
pub fn decode_body<'a>(header: &Header, body: &'a [u8]) -> Result<Body<'a>, FrameDefect> {
    if body.len() != header.len as usize {
        return Err(FrameDefect::Short);
    }
    if crc_of(&header.raw, body) != header.crc {
        return Err(FrameDefect::Crc);
    }
    let u64_at = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&body[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let lsn = Lsn(u64_at(0));
    let step = u64_at(8);
    let kind = RecordKind::from_byte(body[16]).ok_or(FrameDefect::Fields)?;
    let traj_len = body[17] as usize;
    let traj_end = BODY_FIXED + traj_len;
    if traj_len == 0 || traj_len > MAX_TRAJECTORY_LEN || traj_end > body.len() {
        return Err(FrameDefect::Fields);
    }
    let trajectory =
        std::str::from_utf8(&body[BODY_FIXED..traj_end]).map_err(|_| FrameDefect::Fields)?;
    if !super::valid_trajectory(trajectory) {
        return Err(FrameDefect::Fields);
    }
    Ok(Body {
        lsn,
        step,
        kind,
        trajectory,
        payload: &body[traj_end..],
    })
}

/// Decodes one whole frame at the start of `buf`; returns the body and the frame length.
pub fn decode_frame(buf: &[u8]) -> Result<(Body<'_>, usize), FrameDefect> {
    let header = decode_header(buf)?;
    let body = buf
        .get(HEADER_LEN..header.frame_len())
        .ok_or(FrameDefect::Short)?;
    Ok((decode_body(&header, body)?, header.frame_len()))
}

/// The file name of the segment whose first record is `first`.
pub fn segment_name(first: Lsn) -> String {
    format!("seg-{:020}.log", first.0)
}

/// The temporary file a compaction of segment `first` writes before renaming it over the
/// segment. Recovery deletes leftovers.
pub fn compacting_name(first: Lsn) -> String {
    format!("seg-{:020}.log.compacting", first.0)
}

/// Parses a segment file name back to its first lsn.
pub fn parse_segment_name(name: &str) -> Option<Lsn> {
    let digits = name.strip_prefix("seg-")?.strip_suffix(".log")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().map(Lsn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let mut buf = Vec::new();
        encode(
            &mut buf,
            Lsn(7),
            "traj-1",
            3,
            RecordKind::Result,
            b"{\"x\":1}",
        );
        assert_eq!(buf.len(), frame_len(6, 7));
        let (body, n) = decode_frame(&buf).expect("valid frame");
        assert_eq!(n, buf.len());
        assert_eq!(body.lsn, Lsn(7));
        assert_eq!(body.step, 3);
        assert_eq!(body.kind, RecordKind::Result);
        assert_eq!(body.trajectory, "traj-1");
        assert_eq!(body.payload, b"{\"x\":1}");
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let mut buf = Vec::new();
        encode(&mut buf, Lsn(1), "t", 0, RecordKind::Intent, b"payload");
        for bit in 0..buf.len() * 8 {
            let mut b = buf.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_frame(&b).is_err(), "flip of bit {bit} not detected");
        }
    }

    #[test]
    fn segment_names() {
        assert_eq!(segment_name(Lsn(42)), "seg-00000000000000000042.log");
        assert_eq!(
            parse_segment_name("seg-00000000000000000042.log"),
            Some(Lsn(42))
        );
        assert_eq!(parse_segment_name("seg-42.log"), None);
        assert_eq!(parse_segment_name("seg-0000000000000000004x.log"), None);
        assert_eq!(
            parse_segment_name("seg-00000000000000000042.log.corrupt"),
            None
        );
    }

    #[test]
    fn segment_header_round_trip_and_damage() {
        let h = SegmentHeader {
            first: Lsn(10),
            end: Lsn(25),
        };
        let mut buf = Vec::new();
        encode_segment_header(&mut buf, h);
        assert_eq!(buf.len(), SEGMENT_HEADER_LEN);
        assert_eq!(decode_segment_header(&buf), Ok(Some(h)));
        let mut frame = Vec::new();
        encode(&mut frame, Lsn(1), "t", 0, RecordKind::Intent, b"");
        assert_eq!(decode_segment_header(&frame), Ok(None));
        assert_eq!(decode_segment_header(&[]), Ok(None));
        for bit in 32..buf.len() * 8 {
            let mut b = buf.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_segment_header(&b).is_err(), "flip of bit {bit}");
        }
        assert_eq!(decode_segment_header(&buf[..10]), Err(FrameDefect::Short));
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_frame(&bytes);
        }

        #[test]
        fn decoding_mangled_header_never_panics(len in any::<u32>(), rest in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut b = MAGIC.to_le_bytes().to_vec();
            b.extend_from_slice(&len.to_le_bytes());
            b.extend_from_slice(&rest);
            let _ = decode_frame(&b);
        }
    }
}
