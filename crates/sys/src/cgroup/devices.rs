//! Device allowlists of cgroups ([`Cgroup::limit_devices`](super::Cgroup::limit_devices)).
//!
//! A process in a cgroup with a list may create (`mknod`) and open only the character and block
//! devices the list names; anything else fails with `EPERM`, whatever the mount flags, the file
//! modes and the process's capabilities. On cgroup v1 the list is the `devices` controller's:
//! `a` written into `devices.deny` (deny everything, forget every exception), then one
//! `devices.allow` line per rule; the kernel shows the result in `devices.list`.
//!
//! cgroup v2 has no `devices` files: the list is an eBPF program of type
//! `BPF_PROG_TYPE_CGROUP_DEVICE` ([`program`], hand-assembled as runc and youki do), loaded with
//! `bpf(BPF_PROG_LOAD)` and attached to the cgroup's directory with `bpf(BPF_PROG_ATTACH,
//! BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI)` ([`attach_program`]); the kernel runs it on every
//! device `open` and `mknod` of the cgroup's processes (with the programs of its ancestors,
//! which must all allow), and drops it with the cgroup. The program compares the request with
//! each rule in turn and answers 1 (allow) at the first match, 0 (`EPERM`) after the last.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use super::CgroupError;

/// Character or block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// A character device (`c`).
    Char,
    /// A block device (`b`).
    Block,
}

/// Access bit: create a node (`mknod`). Same value as the kernel's `BPF_DEVCG_ACC_MKNOD`.
pub const ACCESS_MKNOD: u8 = 1;
/// Access bit: open for reading. Same value as `BPF_DEVCG_ACC_READ`.
pub const ACCESS_READ: u8 = 2;
/// Access bit: open for writing. Same value as `BPF_DEVCG_ACC_WRITE`.
pub const ACCESS_WRITE: u8 = 4;

/// One allowed device, or every minor (or major) of one: `None` is any number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRule {
    /// Character or block.
    pub kind: DeviceKind,
    /// The major number; `None` for any.
    pub major: Option<u32>,
    /// The minor number; `None` for any.
    pub minor: Option<u32>,
    /// What is allowed: [`ACCESS_READ`], [`ACCESS_WRITE`], [`ACCESS_MKNOD`], or'ed.
    pub access: u8,
}

impl DeviceRule {
    /// A rule for character device `major:minor` (`None`: every minor).
    pub const fn char(major: u32, minor: Option<u32>, access: u8) -> Self {
        Self {
            kind: DeviceKind::Char,
            major: Some(major),
            minor,
            access,
        }
    }

    /// The rule as a line of v1 `devices.allow` (and of `devices.list`): `c 1:3 rwm`,
    /// `c 136:* rw`.
    pub fn v1_line(&self) -> String {
        let kind = match self.kind {
            DeviceKind::Char => 'c',
            DeviceKind::Block => 'b',
        };
        let num = |n: Option<u32>| n.map_or_else(|| "*".to_owned(), |n| n.to_string());
        let mut access = String::with_capacity(3);
        for (bit, c) in [(ACCESS_READ, 'r'), (ACCESS_WRITE, 'w'), (ACCESS_MKNOD, 'm')] {
            if self.access & bit != 0 {
                access.push(c);
            }
        }
        format!("{kind} {}:{} {access}", num(self.major), num(self.minor))
    }
}

/// One eBPF instruction (`struct bpf_insn`): opcode, registers (`dst | src << 4`), offset,
/// immediate.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BpfInsn {
    /// Opcode.
    pub code: u8,
    /// Destination register in the low nibble, source register in the high one.
    pub regs: u8,
    /// Jump offset (in instructions, from the next one) or memory offset.
    pub off: i16,
    /// Immediate.
    pub imm: i32,
}

// eBPF opcodes (linux/bpf.h, linux/bpf_common.h): class | operation | source.
const LDX_MEM_W: u8 = 0x61; // BPF_LDX | BPF_MEM | BPF_W: dst = *(u32 *)(src + off)
const AND32_K: u8 = 0x54; // BPF_ALU | BPF_AND | BPF_K: dst &= imm (32 bit)
const RSH32_K: u8 = 0x74; // BPF_ALU | BPF_RSH | BPF_K
const MOV32_K: u8 = 0xb4; // BPF_ALU | BPF_MOV | BPF_K
const MOV32_X: u8 = 0xbc; // BPF_ALU | BPF_MOV | BPF_X
const JNE_K: u8 = 0x55; // BPF_JMP | BPF_JNE | BPF_K: if dst != imm goto +off
const JNE_X: u8 = 0x5d; // BPF_JMP | BPF_JNE | BPF_X: if dst != src goto +off
const EXIT: u8 = 0x95; // BPF_JMP | BPF_EXIT: return r0

// `struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }`; `access_type` is
// `access << 16 | type`.
const DEV_BLOCK: i32 = 1; // BPF_DEVCG_DEV_BLOCK
const DEV_CHAR: i32 = 2; // BPF_DEVCG_DEV_CHAR
const ACCESS_ALL: u8 = ACCESS_MKNOD | ACCESS_READ | ACCESS_WRITE;

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> BpfInsn {
    BpfInsn {
        code,
        regs: dst | (src << 4),
        off,
        imm,
    }
}

/// The `BPF_PROG_TYPE_CGROUP_DEVICE` program allowing what `allowed` names: r2 = the device type,
/// r3 = the access asked for, r4 = major, r5 = minor; one block per rule that falls through to
/// the next rule's on any mismatch and returns 1 when every field matches; 0 after the last.
pub fn program(allowed: &[DeviceRule]) -> Vec<BpfInsn> {
    let mut prog = vec![
        insn(LDX_MEM_W, 2, 1, 0, 0),
        insn(AND32_K, 2, 0, 0, 0xffff),
        insn(LDX_MEM_W, 3, 1, 0, 0),
        insn(RSH32_K, 3, 0, 0, 16),
        insn(LDX_MEM_W, 4, 1, 4, 0),
        insn(LDX_MEM_W, 5, 1, 8, 0),
    ];
    for rule in allowed {
        // Each check is (the jump, its operand); offsets are filled in once the block's length
        // is known: the jump goes to the first instruction after the block.
        let mut block: Vec<BpfInsn> = Vec::with_capacity(8);
        let kind = match rule.kind {
            DeviceKind::Char => DEV_CHAR,
            DeviceKind::Block => DEV_BLOCK,
        };
        block.push(insn(JNE_K, 2, 0, 0, kind));
        if rule.access & ACCESS_ALL != ACCESS_ALL {
            // (asked & allowed) == asked
            block.push(insn(MOV32_X, 1, 3, 0, 0));
            block.push(insn(AND32_K, 1, 0, 0, i32::from(rule.access)));
            block.push(insn(JNE_X, 1, 3, 0, 0));
        }
        if let Some(major) = rule.major {
            block.push(insn(JNE_K, 4, 0, 0, major as i32));
        }
        if let Some(minor) = rule.minor {
            block.push(insn(JNE_K, 5, 0, 0, minor as i32));
        }
        block.push(insn(MOV32_K, 0, 0, 0, 1));
        block.push(insn(EXIT, 0, 0, 0, 0));
        let len = block.len();
        for (i, ins) in block.iter_mut().enumerate() {
            if ins.code == JNE_K || ins.code == JNE_X {
                ins.off = i16::try_from(len - i - 1)
                    .expect("invariant: a rule's block is a few instructions");
            }
        }
        prog.extend(block);
    }
    prog.push(insn(MOV32_K, 0, 0, 0, 0));
    prog.push(insn(EXIT, 0, 0, 0, 0));
    prog
}

// bpf(2) commands, program and attach types, flags.
const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_PROG_ATTACH: libc::c_int = 8;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
const BPF_F_ALLOW_MULTI: u32 = 2;

/// The head of `union bpf_attr` for `BPF_PROG_LOAD` (the kernel takes a shorter attr as the
/// fields it has, the rest zero).
#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// The head of `union bpf_attr` for `BPF_PROG_ATTACH`.
#[repr(C)]
struct ProgAttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
    replace_bpf_fd: u32,
}

fn bpf<T>(cmd: libc::c_int, attr: &T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised `repr(C)` head of `union bpf_attr` for `cmd`, passed
    // with its exact size; the kernel reads it (and the memory its pointers name, which the
    // callers keep alive over the call) and writes nothing back for these commands.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *const T,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ret)
}

/// Loads [`program`]`(allowed)` and attaches it to the cgroup v2 directory `dir`
/// (`BPF_F_ALLOW_MULTI`, as systemd and runc attach theirs, so an ancestor's program still runs
/// and a program of dsec's does not displace another's). The cgroup keeps the program until it
/// is removed.
pub fn attach_program(dir: &Path, allowed: &[DeviceRule]) -> Result<(), CgroupError> {
    let err = |step, source| CgroupError::DeviceProgram {
        path: dir.to_owned(),
        step,
        source,
    };
    let prog = program(allowed);
    let license = c"Apache-2.0";
    let mut name = [0u8; 16];
    name[..12].copy_from_slice(b"dsec_devices");
    let load = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_CGROUP_DEVICE,
        insn_cnt: u32::try_from(prog.len())
            .map_err(|_| err("load", io::ErrorKind::InvalidInput.into()))?,
        insns: prog.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 0,
        log_size: 0,
        log_buf: 0,
        kern_version: 0,
        prog_flags: 0,
        prog_name: name,
        prog_ifindex: 0,
        expected_attach_type: BPF_CGROUP_DEVICE,
    };
    let fd = bpf(BPF_PROG_LOAD, &load).map_err(|e| err("load", e))?;
    let fd = i32::try_from(fd).map_err(|_| err("load", io::ErrorKind::InvalidData.into()))?;
    // SAFETY: BPF_PROG_LOAD just returned `fd`, a new program descriptor nothing else owns.
    let prog_fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let cgroup = File::open(dir).map_err(|e| err("open", e))?;
    let attach = ProgAttachAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog_fd.as_raw_fd() as u32,
        attach_type: BPF_CGROUP_DEVICE,
        attach_flags: BPF_F_ALLOW_MULTI,
        replace_bpf_fd: 0,
    };
    bpf(BPF_PROG_ATTACH, &attach).map_err(|e| err("attach", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the subset of eBPF that [`program`] emits on a device request.
    fn run(prog: &[BpfInsn], kind: i32, access: u8, major: u32, minor: u32) -> u32 {
        let ctx = [(u32::from(access) << 16) | kind as u32, major, minor];
        let mut r = [0u32; 11];
        let mut pc = 0usize;
        loop {
            let i = prog[pc];
            pc += 1;
            let (dst, src) = (usize::from(i.regs & 0xf), usize::from(i.regs >> 4));
            match i.code {
                LDX_MEM_W => {
                    assert_eq!(src, 1, "loads from the context only");
                    r[dst] = ctx[usize::try_from(i.off).expect("offset") / 4];
                }
                AND32_K => r[dst] &= i.imm as u32,
                RSH32_K => r[dst] >>= i.imm,
                MOV32_K => r[dst] = i.imm as u32,
                MOV32_X => r[dst] = r[src],
                JNE_K | JNE_X => {
                    let other = if i.code == JNE_K {
                        i.imm as u32
                    } else {
                        r[src]
                    };
                    if r[dst] != other {
                        pc += usize::try_from(i.off).expect("forward jumps only");
                    }
                }
                EXIT => return r[0],
                other => panic!("unexpected opcode {other:#x}"),
            }
        }
    }

    /// What `allowed` says about a request, rule by rule.
    fn reference(allowed: &[DeviceRule], block: bool, access: u8, major: u32, minor: u32) -> u32 {
        u32::from(allowed.iter().any(|r| {
            (r.kind == DeviceKind::Block) == block
                && access & r.access == access
                && r.major.is_none_or(|m| m == major)
                && r.minor.is_none_or(|m| m == minor)
        }))
    }

    #[test]
    fn program_allows_exactly_the_rules() {
        let rules = [
            DeviceRule::char(1, Some(3), ACCESS_ALL),
            DeviceRule::char(5, Some(2), RW),
            DeviceRule::char(136, None, RW),
            DeviceRule {
                kind: DeviceKind::Block,
                major: None,
                minor: Some(0),
                access: ACCESS_MKNOD,
            },
        ];
        let prog = program(&rules);
        // The prologue (6); per rule the type, the access unless it is all three (3), the
        // numbers that are not `*`, and the answer (2); the refusal (2).
        assert_eq!(prog.len(), 6 + 5 + 8 + 7 + 7 + 2);
        let mut allowed = 0;
        for block in [false, true] {
            let kind = if block { DEV_BLOCK } else { DEV_CHAR };
            for access in 1..=ACCESS_ALL {
                for (major, minor) in [(1, 3), (1, 1), (5, 2), (5, 0), (136, 0), (136, 9999)]
                    .into_iter()
                    .chain([(7, 0), (0, 0), (3, 1)])
                {
                    let want = reference(&rules, block, access, major, minor);
                    let got = run(&prog, kind, access, major, minor);
                    assert_eq!(got, want, "{block} {access} {major}:{minor}");
                    allowed += got;
                }
            }
        }
        // c 1:3 with any access (7); c 5:2, 136:0 and 136:9999 for r, w, rw (9); mknod of the
        // block devices of the four pairs with minor 0 (4).
        assert_eq!(allowed, 7 + 9 + 4);
        // Nothing allows nothing.
        assert_eq!(program(&[]).len(), 8);
        assert_eq!(run(&program(&[]), DEV_CHAR, ACCESS_READ, 1, 3), 0);
    }

    #[test]
    fn jumps_land_on_the_next_rule() {
        let prog = program(&[DeviceRule::char(1, Some(3), RW)]);
        let block = &prog[6..prog.len() - 2];
        assert_eq!(block.len(), 8);
        for (i, ins) in block.iter().enumerate() {
            if matches!(ins.code, JNE_K | JNE_X) {
                assert_eq!(usize::try_from(ins.off).ok(), Some(block.len() - i - 1));
            }
        }
        assert_eq!(std::mem::size_of::<BpfInsn>(), 8);
        assert_eq!(std::mem::size_of::<ProgLoadAttr>(), 72);
        assert_eq!(std::mem::size_of::<ProgAttachAttr>(), 20);
    }

    const RW: u8 = ACCESS_READ | ACCESS_WRITE;

    #[test]
    fn v1_lines() {
        assert_eq!(
            DeviceRule::char(1, Some(3), RW | ACCESS_MKNOD).v1_line(),
            "c 1:3 rwm"
        );
        assert_eq!(DeviceRule::char(136, None, RW).v1_line(), "c 136:* rw");
        let any_block = DeviceRule {
            kind: DeviceKind::Block,
            major: None,
            minor: None,
            access: ACCESS_MKNOD,
        };
        assert_eq!(any_block.v1_line(), "b *:* m");
    }
}
