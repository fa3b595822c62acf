//! Users of the sandbox: a name resolved to ids through the sandbox's own `/etc/passwd` and
//! `/etc/group` (never the host's), the users a sandbox must have made where its template
//! lacks them, the default user of commands and file requests, and the per-thread file-system
//! ids under which a file request runs as a user.
//!
//! The agent of a container sandbox holds `CAP_SETUID`, `CAP_SETGID`, `CAP_CHOWN` and `CAP_KILL` in the
//! sandbox's user namespace and nothing else (see `dsec_sys::launch`); every command it starts
//! clears them ([`drop_caps`]).

use std::io::Read as _;
use std::sync::{OnceLock, RwLock};

use dsec_api::ErrorCode;
use dsec_sys::proc::{Credentials, MAX_GROUPS};

use crate::files::{db_lines, FileError, Root};

/// Most bytes of `/etc/passwd` or `/etc/group` read.
const MAX_DB: u64 = 1 << 20;

/// A resolved user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Name (the uid's digits when the sandbox has no entry for it).
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups (from `/etc/group`).
    pub groups: Vec<u32>,
    /// Home directory.
    pub home: String,
}

impl User {
    /// The credentials a command of this user starts with.
    pub fn credentials(&self) -> Credentials {
        Credentials {
            uid: self.uid,
            gid: self.gid,
            groups: self.groups.clone(),
        }
    }

    /// `HOME`, `USER` and `LOGNAME` of this user.
    pub fn env(&self) -> [(String, String); 3] {
        [
            ("HOME".into(), self.home.clone()),
            ("USER".into(), self.name.clone()),
            ("LOGNAME".into(), self.name.clone()),
        ]
    }
}

/// Errors resolving or making a user.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    /// No such user in the sandbox.
    #[error("the sandbox has no user {0:?}")]
    Unknown(String),
    /// The name is malformed.
    #[error("{0}")]
    Invalid(String),
    /// Reading or writing the user database or the home failed.
    #[error("user database")]
    File(#[from] FileError),
    /// Changing the thread's ids failed.
    #[error("switch to user {user:?}")]
    Switch {
        /// The user.
        user: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

impl UserError {
    /// The wire code.
    pub fn code(&self) -> ErrorCode {
        match self {
            UserError::Unknown(_) | UserError::Invalid(_) => ErrorCode::InvalidRequest,
            UserError::File(e) => e.code(),
            UserError::Switch { .. } => ErrorCode::PermissionDenied,
        }
    }
}

/// The user of commands and file requests that name none (`None`: root).
static DEFAULT_USER: RwLock<Option<String>> = RwLock::new(None);

/// Sets the default user (a `Configure`).
pub fn set_default(user: Option<String>) {
    if let Ok(mut g) = DEFAULT_USER.write() {
        *g = user.filter(|u| u != "root" && u != "0");
    }
}

/// The user a request runs as: the one it names, else the default; `None` for root.
pub fn effective(requested: Option<&str>) -> Option<String> {
    match requested {
        Some(u) => Some(u.to_owned()),
        None => DEFAULT_USER.read().ok().and_then(|g| g.clone()),
    }
}

/// Whether commands must drop the capabilities the agent holds: true where the agent was
/// launched holding only its few (a container sandbox: the bounding set is empty), false in a
/// VM guest or a test, where commands run as root always did.
pub fn drop_caps() -> bool {
    static DROP: OnceLock<bool> = OnceLock::new();
    *DROP.get_or_init(|| !dsec_sys::proc::bounding_has(7 /* CAP_SETUID */))
}

fn read_db(root: &Root, path: &str) -> Result<String, FileError> {
    match root.open_read(path) {
        Ok((f, _)) => {
            let mut s = Vec::new();
            let _ = f.take(MAX_DB).read_to_end(&mut s);
            Ok(String::from_utf8_lossy(&s).into_owned())
        }
        Err(e) if e.code() == ErrorCode::NotFound => Ok(String::new()),
        Err(e) => Err(e),
    }
}

/// A `passwd` entry: name, uid, gid, home.
fn passwd_entries(db: &str) -> impl Iterator<Item = (&str, u32, u32, &str)> {
    db_lines(db, 7).filter_map(|f| Some((f[0], f[2].parse().ok()?, f[3].parse().ok()?, f[5])))
}

/// A `group` entry: name, gid, members.
fn group_entries(db: &str) -> impl Iterator<Item = (&str, u32, &str)> {
    db_lines(db, 4).filter_map(|f| Some((f[0], f[2].parse().ok()?, f[3])))
}

/// Resolves `name` (or a numeric uid) in the sandbox.
pub fn resolve(root: &Root, name: &str) -> Result<User, UserError> {
    dsec_api::exec::validate_user(name).map_err(UserError::Invalid)?;
    let passwd = read_db(root, "/etc/passwd")?;
    let numeric: Option<u32> = name.parse().ok();
    let entry = passwd_entries(&passwd).find(|e| match numeric {
        Some(uid) => e.1 == uid,
        None => e.0 == name,
    });
    let (name, uid, gid, home) = match (entry, numeric) {
        (Some((n, u, g, h)), _) => (n.to_owned(), u, g, h.to_owned()),
        (None, Some(uid)) => (name.to_owned(), uid, uid, "/".to_owned()),
        (None, None) if name == "root" => ("root".to_owned(), 0, 0, "/root".to_owned()),
        (None, None) => return Err(UserError::Unknown(name.to_owned())),
    };
    let group = read_db(root, "/etc/group")?;
    let mut groups = vec![gid];
    for (_, g, members) in group_entries(&group) {
        if groups.len() >= MAX_GROUPS {
            break;
        }
        if !groups.contains(&g) && members.split(',').any(|m| m == name) {
            groups.push(g);
        }
    }
    Ok(User {
        name,
        uid,
        gid,
        groups,
        home: if home.is_empty() { "/".into() } else { home },
    })
}

/// Makes each `(name, uid)` the sandbox lacks: entries in `/etc/passwd` and `/etc/group` (its
/// own group, of the same id) and a home `/home/<name>` of theirs (mode 0755).
pub fn ensure(root: &Root, users: &[(String, u32)]) -> Result<(), UserError> {
    for (name, uid) in users {
        dsec_api::exec::validate_user(name).map_err(UserError::Invalid)?;
        if name.parse::<u32>().is_ok() {
            return Err(UserError::Invalid(format!(
                "a user to make needs a name, not {name:?}"
            )));
        }
        let passwd = read_db(root, "/etc/passwd")?;
        let home = format!("/home/{name}");
        let known = passwd_entries(&passwd).find(|e| e.0 == name);
        let home = match known {
            Some((_, u, g, h)) => {
                if *uid != u {
                    continue; // the template has the name with ids of its own: keep them
                }
                ensure_home(root, if h.is_empty() { &home } else { h }, u, g)?;
                continue;
            }
            None => home,
        };
        let shell = if root.stat("/bin/bash").is_ok() {
            "/bin/bash"
        } else {
            "/bin/sh"
        };
        // First, so that the uid's name is this one even where the template has another
        // account of that uid (`whoami` answers the first).
        let mut p = format!("{name}:x:{uid}:{uid}::{home}:{shell}\n");
        p.push_str(&passwd);
        root.write_atomic("/etc/passwd", p.as_bytes(), 0o644, true)?;
        let mut g = read_db(root, "/etc/group")?;
        if !group_entries(&g).any(|e| e.0 == name) {
            g.insert_str(0, &format!("{name}:x:{uid}:\n"));
            root.write_atomic("/etc/group", g.as_bytes(), 0o644, true)?;
        }
        ensure_home(root, &home, *uid, *uid)?;
    }
    Ok(())
}

fn ensure_home(root: &Root, home: &str, uid: u32, gid: u32) -> Result<(), UserError> {
    if root.stat(home).is_ok() {
        return Ok(());
    }
    let dir = root.mkdir_p(home, 0o755)?;
    use std::os::fd::AsFd as _;
    dsec_sys::proc::fchown(dir.as_fd(), uid, gid).map_err(|source| UserError::Switch {
        user: uid.to_string(),
        source,
    })
}

/// While alive, the calling thread's file accesses are checked as a user and what it creates
/// is theirs; dropping it restores the agent's own ids.
pub struct AsUser {
    groups: Vec<u32>,
}

impl AsUser {
    /// Switches the calling thread to `user`'s file-system ids.
    pub fn enter(user: &User) -> Result<Self, UserError> {
        let groups = dsec_sys::proc::thread_groups();
        dsec_sys::proc::set_thread_fs_ids(user.uid, user.gid, &user.groups).map_err(|source| {
            UserError::Switch {
                user: user.name.clone(),
                source,
            }
        })?;
        Ok(Self { groups })
    }
}

impl Drop for AsUser {
    fn drop(&mut self) {
        if dsec_sys::proc::restore_thread_fs_ids(&self.groups).is_err() {
            // The thread cannot be trusted with the agent's ids again.
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwd_lines_parse_defensively() {
        let db = "root:x:0:0:root:/root:/bin/bash\nbad\nuser:x:1000:1000::/home/user:/bin/sh\n::::\nx:x:notanumber:1::/:/bin/sh\n";
        let v: Vec<_> = passwd_entries(db).collect();
        assert_eq!(
            v,
            vec![("root", 0, 0, "/root"), ("user", 1000, 1000, "/home/user")]
        );
        let g: Vec<_> = group_entries("sudo:x:27:user,other\nbroken\n").collect();
        assert_eq!(g, vec![("sudo", 27, "user,other")]);
    }
}
