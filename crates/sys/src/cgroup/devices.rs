//! Device allowlists of cgroups ([`Cgroup::limit_devices`](super::Cgroup::limit_devices)).
//!
//! A process in a cgroup with a list may create (`mknod`) and open only the character and block
//! devices the list names; anything else fails with `EPERM`, whatever the mount flags, the file
//! modes and the process's capabilities. On cgroup v1 the list is the `devices` controller's:
//! `a` written into `devices.deny` (deny everything, forget every exception), then one
//! `devices.allow` line per rule; the kernel shows the result in `devices.list`.

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

#[cfg(test)]
mod tests {
    use super::*;

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
