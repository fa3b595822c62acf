//! Launch failures as the node receives them: which step failed, with which OS error.

use std::error::Error;
use std::io;

use dsec_api::error::chain;
use dsec_sys::cgroup::CgroupError;
use dsec_sys::launch::LaunchError;

use crate::proto::{LaunchFailure, LaunchStep};

/// The first OS error number in `e`'s chain of sources.
fn errno_in_chain(e: &(dyn Error + 'static)) -> Option<i32> {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(n) = c
            .downcast_ref::<io::Error>()
            .and_then(io::Error::raw_os_error)
        {
            return Some(n);
        }
        cur = c.source();
    }
    None
}

/// A failure of `step` caused by `e`, with the OS error found in its chain.
pub(crate) fn failure(step: LaunchStep, e: &(dyn Error + 'static)) -> LaunchFailure {
    LaunchFailure {
        step,
        errno: errno_in_chain(e),
        message: chain(e),
    }
}

/// A failure of the cgroup step `e` belongs to: making or renaming the directory, or writing
/// a limit (the device list among them).
pub(crate) fn cgroup_failure(e: &CgroupError) -> LaunchFailure {
    let step = match e {
        CgroupError::Write { .. }
        | CgroupError::InvalidLimit { .. }
        | CgroupError::DeviceProgram { .. } => LaunchStep::CgroupLimits,
        CgroupError::Attach { .. } => LaunchStep::CgroupAttach,
        _ => LaunchStep::CgroupCreate,
    };
    failure(step, e)
}

/// A failure of a launch (a clone, a pivot of a running shell, a hostname change) at the step
/// `e` names.
pub(crate) fn launch_failure(e: &LaunchError) -> LaunchFailure {
    let step = match e {
        LaunchError::Clone(_) | LaunchError::NotSingleThreaded { .. } => LaunchStep::Clone,
        LaunchError::Fork(_) => LaunchStep::Fork,
        LaunchError::IdMap { .. } => LaunchStep::IdMap,
        LaunchError::Create { what, .. } => match *what {
            "cgroup attach" => LaunchStep::CgroupAttach,
            "staging directory" => LaunchStep::Rootfs,
            "release" => LaunchStep::Setup,
            _ => LaunchStep::Sockets,
        },
        LaunchError::InvalidArgument { what } => child_step(what),
        LaunchError::ChildSetup { step, errno } => {
            return LaunchFailure {
                step: child_step(step),
                errno: errno.raw_os_error().filter(|&n| n != 0),
                message: chain(e),
            }
        }
    };
    failure(step, e)
}

/// The step a setup step of the sandbox init (as `dsec_sys::launch` names it) belongs to.
fn child_step(name: &str) -> LaunchStep {
    match name {
        "execveat" => LaunchStep::ExecAgent,
        "pivot_root" | "umount_old_root" | "chdir_root" | "chdir_new_root" | "setns_sandbox"
        | "mkdir_mountpoint" | "move_mount" | "move_pts" | "move_mqueue" | "move_proc"
        | "setns_back" => LaunchStep::Pivot,
        "hostname" | "sethostname" | "setns_uts" | "setns_uts_back" | "pid" => LaunchStep::Hostname,
        "cgroup_ns" | "time_ns" | "private" | "unshare_mnt" => LaunchStep::Namespaces,
        "setresgid" | "setresuid" | "securebits" | "ambient" | "capbset" | "capset" | "seccomp" => {
            LaunchStep::Privileges
        }
        "open_dev_null" | "dup_dev_null" | "dup_high" | "stdio" | "dup_low" | "close_range"
        | "setrlimit" | "lo_up" => LaunchStep::Process,
        "pdeathsig" | "params_size" | "params" | "prepare" | "release" => LaunchStep::Setup,
        _ => LaunchStep::Rootfs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn a_child_setup_failure_keeps_its_step_and_errno() {
        let e = LaunchError::ChildSetup {
            step: "overlay".into(),
            errno: io::Error::from_raw_os_error(12),
        };
        let f = launch_failure(&e);
        assert_eq!((f.step, f.errno), (LaunchStep::Rootfs, Some(12)));
        assert!(f.message.contains("overlay"), "{}", f.message);
        let exec = LaunchError::ChildSetup {
            step: "execveat".into(),
            errno: io::Error::from_raw_os_error(0),
        };
        let f = launch_failure(&exec);
        assert_eq!((f.step, f.errno), (LaunchStep::ExecAgent, None));
    }

    #[test]
    fn a_clone_failure_carries_the_os_error() {
        let f = launch_failure(&LaunchError::Clone(io::Error::from_raw_os_error(11)));
        assert_eq!((f.step, f.errno), (LaunchStep::Clone, Some(11)));
        let f = launch_failure(&LaunchError::Create {
            what: "cgroup attach",
            source: io::Error::from_raw_os_error(28),
        });
        assert_eq!((f.step, f.errno), (LaunchStep::CgroupAttach, Some(28)));
    }

    #[test]
    fn cgroup_failures_tell_creating_from_limiting() {
        let create = CgroupError::Create {
            path: PathBuf::from("/sys/fs/cgroup/dsec/sb-x"),
            source: io::Error::from_raw_os_error(28),
        };
        let f = cgroup_failure(&create);
        assert_eq!((f.step, f.errno), (LaunchStep::CgroupCreate, Some(28)));
        let write = CgroupError::Write {
            file: PathBuf::from("/sys/fs/cgroup/dsec/sb-x/memory.max"),
            value: "1".into(),
            source: io::Error::from_raw_os_error(16),
        };
        let f = cgroup_failure(&write);
        assert_eq!((f.step, f.errno), (LaunchStep::CgroupLimits, Some(16)));
        assert!(f.message.contains("memory.max"), "{}", f.message);
        let program = CgroupError::DeviceProgram {
            path: PathBuf::from("/sys/fs/cgroup/dsec/sb-x"),
            step: "attach",
            source: io::Error::from_raw_os_error(1),
        };
        let f = cgroup_failure(&program);
        assert_eq!((f.step, f.errno), (LaunchStep::CgroupLimits, Some(1)));
    }
}
