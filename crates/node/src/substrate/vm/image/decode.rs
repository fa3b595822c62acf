//! Pure decoders of kernel artifacts: the LZ4 legacy frame wrapping a `bzImage`'s payload, the
//! ELF checks that tell a bootable `vmlinux`, and the ELF section reader that finds a module's
//! `.modinfo`. Only `std`: the fuzz target compiles this file on its own, and every function
//! returns `None` (or stops) on malformed input rather than panicking.

/// Magic of an LZ4 "legacy frame", the format of the kernel's LZ4-compressed payload.
pub(super) const LZ4_LEGACY_MAGIC: [u8; 4] = [0x02, 0x21, 0x4c, 0x18];
/// Uncompressed size of every block of a legacy frame but the last.
pub(super) const LZ4_LEGACY_BLOCK: usize = 8 << 20;
/// Upper bound on the compressed size of a legacy block (`LZ4_compressBound`).
const LZ4_LEGACY_BOUND: usize = LZ4_LEGACY_BLOCK + LZ4_LEGACY_BLOCK / 255 + 16;
/// Decompression stops beyond this (a kernel is far smaller), bounding garbage input.
const MAX_VMLINUX: usize = 1 << 30;

/// The bootable ELF `vmlinux` inside a `bzImage` with an LZ4-compressed payload.
///
/// The payload's offset is not recorded anywhere simple, so every occurrence of the legacy
/// frame magic is tried until one decompresses to a bootable ELF. The frame's length is not
/// known either: decompression stops at the first block that cannot be one (the kernel's
/// build appends the uncompressed size after the frame), and [`is_bootable_vmlinux`] judges
/// the result.
pub(super) fn extract_vmlinux(bzimage: &[u8]) -> Option<Vec<u8>> {
    let mut from = 0;
    while let Some(found) = find_bytes(bzimage.get(from..)?, &LZ4_LEGACY_MAGIC) {
        let start = from + found + LZ4_LEGACY_MAGIC.len();
        let data = lz4_legacy_decode(bzimage.get(start..)?);
        if is_bootable_vmlinux(&data) {
            return Some(data);
        }
        from = start;
    }
    None
}

/// The offset of the first occurrence of `needle` in `hay`.
fn find_bytes(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Decodes the blocks of an LZ4 legacy frame (`input` starts right after the magic) until
/// the input ends, a block is invalid, or a short (hence last) block was decoded. Returns
/// what was decoded; callers validate it.
pub(super) fn lz4_legacy_decode(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while let Some(size) = le_u32(input, pos) {
        let size = size as usize;
        if size == 0 || size > LZ4_LEGACY_BOUND {
            break;
        }
        let Some(block) = pos
            .checked_add(4)
            .and_then(|start| input.get(start..start.checked_add(size)?))
        else {
            break;
        };
        let before = out.len();
        if lz4_block_decode(block, &mut out, LZ4_LEGACY_BLOCK).is_none() {
            out.truncate(before);
            break;
        }
        if out.len() - before < LZ4_LEGACY_BLOCK || out.len() > MAX_VMLINUX {
            break;
        }
        pos += 4 + size;
    }
    out
}

/// Decodes one LZ4 block, appending at most `max` bytes to `out`; `None` if it is invalid.
/// Matches may only refer to this block's output (legacy-frame blocks are independent).
pub(super) fn lz4_block_decode(src: &[u8], out: &mut Vec<u8>, max: usize) -> Option<()> {
    let start = out.len();
    let mut i = 0usize;
    loop {
        let token = *src.get(i)?;
        i += 1;
        let literals = lz4_length(src, &mut i, usize::from(token >> 4))?;
        let end = i.checked_add(literals)?;
        if out.len() - start + literals > max {
            return None;
        }
        out.extend_from_slice(src.get(i..end)?);
        i = end;
        if i == src.len() {
            // The last sequence has literals only.
            return Some(());
        }
        let offset = usize::from(le_u16(src, i)?);
        i += 2;
        let length = lz4_length(src, &mut i, usize::from(token & 0x0f))?.checked_add(4)?;
        let produced = out.len() - start;
        if offset == 0 || offset > produced || produced + length > max {
            return None;
        }
        let from = out.len() - offset;
        if offset >= length {
            out.extend_from_within(from..from + length);
        } else {
            // Overlapping copy: a repeated pattern.
            for k in 0..length {
                let byte = *out.get(from + k)?;
                out.push(byte);
            }
        }
    }
}

/// An LZ4 length: the 4-bit `base` from the token, extended by bytes while they are 255.
fn lz4_length(src: &[u8], i: &mut usize, base: usize) -> Option<usize> {
    let mut length = base;
    if base == 0x0f {
        loop {
            let byte = *src.get(*i)?;
            *i += 1;
            length = length.checked_add(usize::from(byte))?;
            if byte != 0xff {
                break;
            }
        }
    }
    Some(length)
}

fn le_u16(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        b.get(off..off.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn le_u32(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(off..off.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn le_u64(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(off..off.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// `b[off..off + len]` with 64-bit ELF offsets, `None` when out of bounds.
fn slice_at(b: &[u8], off: u64, len: u64) -> Option<&[u8]> {
    let off = usize::try_from(off).ok()?;
    let len = usize::try_from(len).ok()?;
    b.get(off..off.checked_add(len)?)
}

/// Whether `elf` starts like a little-endian ELF64 file.
fn is_elf64_le(elf: &[u8]) -> bool {
    elf.get(..6) == Some(&[0x7f, b'E', b'L', b'F', 2, 1][..])
}

const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
/// `XEN_ELFNOTE_PHYS32_ENTRY`: the PVH entry point QEMU needs to boot an ELF kernel.
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

/// Whether `elf` is an x86-64 ELF executable whose segments are all present (not truncated)
/// and which has a PVH entry note — what `qemu -kernel` needs to boot an uncompressed kernel.
pub(super) fn is_bootable_vmlinux(elf: &[u8]) -> bool {
    const ET_EXEC: u16 = 2;
    const EM_X86_64: u16 = 62;
    if !is_elf64_le(elf)
        || le_u16(elf, 0x10) != Some(ET_EXEC)
        || le_u16(elf, 0x12) != Some(EM_X86_64)
    {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) =
        (le_u64(elf, 0x20), le_u16(elf, 0x36), le_u16(elf, 0x38))
    else {
        return false;
    };
    let (Ok(phoff), phentsize) = (usize::try_from(phoff), usize::from(phentsize)) else {
        return false;
    };
    if phentsize < 56 {
        return false;
    }
    let mut loads = 0;
    let mut pvh = false;
    for n in 0..usize::from(phnum) {
        let Some(ph) = n
            .checked_mul(phentsize)
            .and_then(|o| o.checked_add(phoff))
            .and_then(|o| elf.get(o..o.checked_add(56)?))
        else {
            return false;
        };
        let (Some(kind), Some(offset), Some(size)) = (le_u32(ph, 0), le_u64(ph, 8), le_u64(ph, 32))
        else {
            return false;
        };
        let Some(segment) = slice_at(elf, offset, size) else {
            return false;
        };
        match kind {
            PT_LOAD => loads += 1,
            PT_NOTE => pvh |= has_xen_note(segment, XEN_ELFNOTE_PHYS32_ENTRY),
            _ => {}
        }
    }
    loads > 0 && pvh
}

/// Whether the ELF note segment `notes` has a `Xen` note of type `kind`.
fn has_xen_note(notes: &[u8], kind: u32) -> bool {
    let align4 = |n: usize| n.checked_add(3).map(|n| n & !3);
    let mut pos = 0usize;
    while let (Some(namesz), Some(descsz), Some(note_type)) = (
        le_u32(notes, pos),
        le_u32(notes, pos.saturating_add(4)),
        le_u32(notes, pos.saturating_add(8)),
    ) {
        let name_start = pos.saturating_add(12);
        let (Some(name_len), Some(desc_len)) = (align4(namesz as usize), align4(descsz as usize))
        else {
            return false;
        };
        let name = notes.get(name_start..name_start.saturating_add(namesz as usize));
        if note_type == kind && name == Some(&b"Xen\0"[..]) {
            return true;
        }
        let Some(next) = name_start
            .checked_add(name_len)
            .and_then(|p| p.checked_add(desc_len))
        else {
            return false;
        };
        pos = next;
    }
    false
}

/// The contents of the section named `wanted` of the ELF64 little-endian file `elf`.
pub(super) fn elf_section<'a>(elf: &'a [u8], wanted: &[u8]) -> Option<&'a [u8]> {
    if !is_elf64_le(elf) {
        return None;
    }
    let shoff = usize::try_from(le_u64(elf, 0x28)?).ok()?;
    let shentsize = usize::from(le_u16(elf, 0x3a)?);
    let shnum = usize::from(le_u16(elf, 0x3c)?);
    let shstrndx = usize::from(le_u16(elf, 0x3e)?);
    if shentsize < 64 {
        return None;
    }
    // (name offset, file offset, size) of section `n`.
    let header = |n: usize| -> Option<(usize, u64, u64)> {
        let base = shoff.checked_add(n.checked_mul(shentsize)?)?;
        let sh = elf.get(base..base.checked_add(64)?)?;
        Some((le_u32(sh, 0)? as usize, le_u64(sh, 24)?, le_u64(sh, 32)?))
    };
    let (_, names_off, names_size) = header(shstrndx)?;
    let names = slice_at(elf, names_off, names_size)?;
    (0..shnum).find_map(|n| {
        let (name, offset, size) = header(n)?;
        let name = names.get(name..)?;
        let name = name.get(..name.iter().position(|&b| b == 0)?)?;
        if name == wanted {
            slice_at(elf, offset, size)
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::process::Command;

    use proptest::prelude::*;

    use super::super::tools::{find_executable, run};
    use super::*;

    /// An x86-64 ELF executable with one PT_LOAD and, if `pvh`, a Xen PVH entry note.
    fn fake_vmlinux(pvh: bool) -> Vec<u8> {
        let mut elf = vec![0u8; 64 + 2 * 56];
        elf[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        elf[0x10..0x12].copy_from_slice(&2u16.to_le_bytes());
        elf[0x12..0x14].copy_from_slice(&62u16.to_le_bytes());
        elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&2u16.to_le_bytes());
        let note_off = elf.len();
        let note_type: u32 = if pvh { XEN_ELFNOTE_PHYS32_ENTRY } else { 17 };
        for word in [4u32, 4, note_type] {
            elf.extend_from_slice(&word.to_le_bytes());
        }
        elf.extend_from_slice(b"Xen\0\x00\x10\x00\x01");
        let note_len = elf.len() - note_off;
        elf.extend((0..5000u32).map(|n| (n % 251) as u8));
        let total = elf.len();
        let mut ph = |n: usize, kind: u32, off: usize, size: usize| {
            let base = 64 + n * 56;
            elf[base..base + 4].copy_from_slice(&kind.to_le_bytes());
            elf[base + 8..base + 16].copy_from_slice(&(off as u64).to_le_bytes());
            elf[base + 32..base + 40].copy_from_slice(&(size as u64).to_le_bytes());
        };
        ph(0, PT_LOAD, 0, total);
        ph(1, PT_NOTE, note_off, note_len);
        elf
    }

    /// An LZ4 block of literals only (valid, if not compressed).
    fn lz4_literal_block(data: &[u8]) -> Vec<u8> {
        let mut block = Vec::new();
        if data.len() < 15 {
            block.push((data.len() as u8) << 4);
        } else {
            block.push(0xf0);
            let mut rest = data.len() - 15;
            while rest >= 255 {
                block.push(255);
                rest -= 255;
            }
            block.push(rest as u8);
        }
        block.extend_from_slice(data);
        block
    }

    /// A `bzImage`-like blob: setup code, a stray magic followed by garbage, then `vmlinux` as
    /// a one-block legacy frame and the size trailer.
    fn fake_bzimage(vmlinux: &[u8]) -> Vec<u8> {
        let block = lz4_literal_block(vmlinux);
        let mut bzimage = b"setup code".to_vec();
        bzimage.extend_from_slice(&LZ4_LEGACY_MAGIC);
        bzimage.extend_from_slice(b"\x05\x00\x00\x00\xffjunk");
        bzimage.extend_from_slice(&LZ4_LEGACY_MAGIC);
        bzimage.extend_from_slice(&(block.len() as u32).to_le_bytes());
        bzimage.extend_from_slice(&block);
        bzimage.extend_from_slice(&(vmlinux.len() as u32).to_le_bytes());
        bzimage.extend_from_slice(&[0u8; 100]);
        bzimage
    }

    #[test]
    fn lz4_block_with_overlapping_match() {
        // "abc", then a match at offset 3 of length 9, then the literals "xyz".
        let block = [0x35, b'a', b'b', b'c', 3, 0, 0x30, b'x', b'y', b'z'];
        let mut out = Vec::new();
        assert!(lz4_block_decode(&block, &mut out, 1 << 20).is_some());
        assert_eq!(out, b"abcabcabcabcxyz");
        // Offsets before the block's start, and output beyond the limit, are invalid.
        let mut out = b"prefix".to_vec();
        assert!(lz4_block_decode(&[0x10, b'a', 5, 0, 0x00], &mut out, 1 << 20).is_none());
        assert!(lz4_block_decode(&block, &mut Vec::new(), 10).is_none());
        assert!(lz4_block_decode(&[0xf0], &mut Vec::new(), 10).is_none());
    }

    #[test]
    fn vmlinux_from_fake_bzimage() -> anyhow::Result<()> {
        let vmlinux = fake_vmlinux(true);
        assert!(is_bootable_vmlinux(&vmlinux));
        assert!(!is_bootable_vmlinux(&fake_vmlinux(false)));
        assert!(!is_bootable_vmlinux(&vmlinux[..vmlinux.len() - 1]));
        assert!(!is_bootable_vmlinux(b"\x7fELF"));

        assert_eq!(extract_vmlinux(&fake_bzimage(&vmlinux)), Some(vmlinux));
        assert_eq!(extract_vmlinux(b"no payload here"), None);

        // The lz4 tool's legacy format (-l) decodes identically (scripts/test.sh installs lz4).
        assert!(
            find_executable("lz4").is_some(),
            "this test needs the lz4 tool"
        );
        {
            let dir = tempfile::tempdir()?;
            let data: Vec<u8> = (0..(LZ4_LEGACY_BLOCK + 300_000))
                .map(|n| ((n / 7) % 13) as u8 ^ (n % 3) as u8)
                .collect();
            fs::write(dir.path().join("data"), &data)?;
            let out = run(Command::new("lz4")
                .args(["-l", "-c", "-9"])
                .arg(dir.path().join("data")))?;
            let compressed = out
                .stdout
                .strip_prefix(&LZ4_LEGACY_MAGIC[..])
                .ok_or_else(|| anyhow::anyhow!("no legacy magic"))?;
            assert!(compressed.len() < data.len() / 4);
            assert!(lz4_legacy_decode(compressed) == data);
        }
        Ok(())
    }

    /// Runs every decoder on `bytes`; they must return (an error or a bounded result), never
    /// panic.
    fn decode_all(bytes: &[u8]) {
        if let Some(elf) = extract_vmlinux(bytes) {
            assert!(is_bootable_vmlinux(&elf));
        }
        assert!(lz4_legacy_decode(bytes).len() <= bytes.len().saturating_mul(255));
        let mut out = b"kept".to_vec();
        let _ = lz4_block_decode(bytes, &mut out, 300);
        assert!(out.starts_with(b"kept") && out.len() <= 4 + 300);
        let _ = is_bootable_vmlinux(bytes);
        if let Some(section) = elf_section(bytes, b".modinfo") {
            let range = bytes.as_ptr_range();
            assert!(section.is_empty() || range.contains(&section.as_ptr()));
        }
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        ) {
            decode_all(&bytes);
            let mut elf = fake_vmlinux(true);
            let at = bytes.len() % elf.len();
            elf.splice(at.., bytes.iter().copied());
            decode_all(&elf);
        }

        #[test]
        fn truncated_or_mangled_bzimage_is_rejected_without_panic(
            cut in any::<prop::sample::Index>(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..), 0..4),
        ) {
            let vmlinux = fake_vmlinux(true);
            let bzimage = fake_bzimage(&vmlinux);
            // Cut inside the payload: no complete ELF can come out.
            let payload_end = bzimage.len() - 104;
            let short = &bzimage[..cut.index(payload_end)];
            prop_assert_eq!(extract_vmlinux(short), None);
            decode_all(short);
            let mut mangled = bzimage.clone();
            for (at, mask) in flips {
                let at = at.index(mangled.len());
                mangled[at] ^= mask;
            }
            decode_all(&mangled);
        }
    }
}
