//! Fuzzes the guest kernel decoders (dsec-node's `substrate/vm/image/decode.rs`, compiled here on
//! its own: it uses `std` only): the LZ4 legacy-frame and block decoders, the bootable-`vmlinux`
//! check and the ELF section reader must never panic, and their results must stay within bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/node/src/substrate/vm/image/decode.rs"]
mod decode;

fuzz_target!(|data: &[u8]| {
    if let Some(elf) = decode::extract_vmlinux(data) {
        assert!(decode::is_bootable_vmlinux(&elf));
    }
    let legacy = decode::lz4_legacy_decode(data);
    assert!(legacy.len() <= data.len().saturating_mul(255));
    let max = data.first().map_or(0, |b| usize::from(*b) << 4);
    let mut out = b"kept".to_vec();
    let _ = decode::lz4_block_decode(data.get(1..).unwrap_or_default(), &mut out, max);
    assert!(out.starts_with(b"kept") && out.len() <= 4 + max);
    let _ = decode::is_bootable_vmlinux(data);
    if let Some(section) = decode::elf_section(data, b".modinfo") {
        assert!(section.is_empty() || data.as_ptr_range().contains(&section.as_ptr()));
    }
});
