//! Following a request that goes on for minutes — a streaming `Spawn`, a `ProcAttach`, a
//! `Watch` — while other requests on the same sandbox go on.
//!
//! A sandbox's agent connection is held exclusively for each request (the [`Entry`]'s mutex),
//! so a follower cannot hold it. Instead its request is a subscription of the connection
//! ([`AgentConn::subscribe`]): any request on the sandbox routes the follower's events into
//! its channel as it reads, and when the channel is empty [`Follow::next`] takes the mutex
//! for at most [`PUMP_SLICE`] to read (on the blocking pool), then lets go, so another request
//! on the sandbox waits at most that long for it.
//!
//! [`AgentConn::subscribe`]: crate::agent_client::AgentConn::subscribe

use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_api::agent::{Event, Request};

use super::{Entry, Error, Result};
use crate::agent_client::{AgentError, Next, Subscription};
use crate::sandbox::State;
use crate::substrate::RuntimeError;

/// Longest a follower holds its sandbox to read from the agent.
pub const PUMP_SLICE: Duration = Duration::from_millis(10);

/// A request being followed: its events, in order, the terminal one last.
#[derive(Debug)]
pub struct Follow {
    entry: Arc<Entry>,
    sub: Subscription,
    /// The terminal event was taken (or the subscription ended): nothing to detach.
    ended: bool,
}

/// Sends `req` (with `body`) to the agent of the running sandbox `entry` as a followed
/// request (a streaming `Spawn`, a `ProcAttach`, a `Watch`); its events come from
/// [`Follow::next`].
pub async fn follow(entry: &Arc<Entry>, req: Request, body: Vec<u8>) -> Result<Follow> {
    let mut guard = entry.lock().await;
    let state = entry.record().state;
    if guard.is_none() || state != State::Running {
        return Err(Error::Transition(format!(
            "sandbox {} is {state:?}",
            entry.id
        )));
    }
    let id = entry.id.clone();
    let sub = tokio::task::spawn_blocking(move || match guard.as_mut() {
        Some(sb) => sb
            .agent()
            .subscribe(&req, &body)
            .map(|(_, sub)| sub)
            .map_err(|source| Error::Runtime(RuntimeError::Agent { id, source })),
        None => Err(Error::NotFound(id)),
    })
    .await
    .map_err(|e| Error::internal(e.to_string()))??;
    Ok(Follow {
        entry: Arc::clone(entry),
        sub,
        ended: false,
    })
}

impl Follow {
    /// The id of the followed request at the agent.
    pub fn id(&self) -> u64 {
        self.sub.id()
    }

    /// The next event and its body, waiting up to `wait`; `None` when none came in time (the
    /// caller may send a keep-alive and ask again). After the terminal event, an error.
    pub async fn next(&mut self, wait: Duration) -> Option<Result<(Event, Vec<u8>)>> {
        let deadline = Instant::now() + wait;
        loop {
            match self.sub.try_next() {
                Next::Event(ev, body) => {
                    if ev.is_terminal() {
                        self.ended = true;
                    }
                    return Some(Ok((ev, body)));
                }
                Next::Ended => {
                    self.ended = true;
                    return Some(Err(self.lost()));
                }
                Next::Empty => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            // Another request holding the sandbox routes our events as it reads: take them as
            // they come, or the sandbox when it is free.
            let guard = tokio::select! {
                got = self.sub.recv() => {
                    return Some(match got {
                        Some((ev, body)) => {
                            if ev.is_terminal() {
                                self.ended = true;
                            }
                            Ok((ev, body))
                        }
                        None => {
                            self.ended = true;
                            Err(self.lost())
                        }
                    });
                }
                guard = self.entry.lock() => guard,
                () = tokio::time::sleep(left) => return None,
            };
            let slice = left.min(PUMP_SLICE);
            let id = self.entry.id.clone();
            let pumped = tokio::task::spawn_blocking(move || {
                let mut guard = guard;
                match guard.as_mut() {
                    Some(sb) => sb
                        .agent()
                        .pump(slice)
                        .map_err(|source| Error::Runtime(RuntimeError::Agent { id, source })),
                    None => Err(Error::NotFound(id)),
                }
            })
            .await
            .map_err(|e| Error::internal(e.to_string()))
            .and_then(|r| r);
            if let Err(e) = pumped {
                // The subscription may still hold what was routed before the failure.
                if let Next::Event(ev, body) = self.sub.try_next() {
                    if ev.is_terminal() {
                        self.ended = true;
                    }
                    return Some(Ok((ev, body)));
                }
                self.ended = true;
                return Some(Err(e));
            }
        }
    }

    /// The error of a subscription that ended without its terminal event, or was read past it.
    fn lost(&self) -> Error {
        Error::Runtime(RuntimeError::Agent {
            id: self.entry.id.clone(),
            source: AgentError::Unexpected(format!(
                "request {} is followed no more (ended, or the agent connection was replaced)",
                self.sub.id()
            )),
        })
    }

    /// Stops following: the agent is told (`ProcDetach`, `Unwatch`); the process goes on.
    pub async fn detach(mut self) {
        if !self.ended {
            self.ended = true;
            unsubscribe(Arc::clone(&self.entry), self.sub.id()).await;
        }
    }
}

impl Drop for Follow {
    /// A follow dropped before its end (a client that went away) is detached in the
    /// background.
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(unsubscribe(Arc::clone(&self.entry), self.sub.id()));
        }
    }
}

/// Ends subscription `id` on the sandbox's agent connection.
async fn unsubscribe(entry: Arc<Entry>, id: u64) {
    let mut guard = entry.lock().await;
    let _ = tokio::task::spawn_blocking(move || {
        if let Some(sb) = guard.as_mut() {
            sb.agent().unsubscribe(id);
        }
    })
    .await;
}
