//! Following a stream of agent events (a streaming spawn, an attach, a watch) while other
//! requests use the same sandbox: the events are routed to a subscription by whoever reads
//! the agent connection, and while nobody does, the follower reads it in slices of at most
//! [`SLICE`] under the sandbox's lock, so a request waiting for the lock waits no longer.

use crate::agent_client::{Next, Subscription};

use super::*;

/// Longest hold of the sandbox's lock by one read of a follower.
const SLICE: Duration = Duration::from_millis(10);

/// A followed request.
pub(super) struct Follow {
    app: AppState,
    entry: Arc<Entry>,
    sub: Subscription,
    ended: bool,
}

impl Follow {
    /// Sends `req` as a subscription.
    pub(super) async fn start(
        app: &AppState,
        entry: &Arc<Entry>,
        req: AgentReq,
        body: Vec<u8>,
    ) -> Result<Self, ApiError> {
        let sub = with_sandbox(app, entry, move |_, sb| {
            sb.agent()
                .subscribe(&req, &body)
                .map(|(_, s)| s)
                .map_err(ApiError::from)
        })
        .await?;
        Ok(Self {
            app: app.clone(),
            entry: Arc::clone(entry),
            sub,
            ended: false,
        })
    }

    /// The next event, waiting at most `wait`: `None` when none came in time; an agent
    /// `Error` event, or the connection's end, as `Err`.
    pub(super) async fn next(
        &mut self,
        wait: Duration,
    ) -> Option<Result<(Event, Vec<u8>), ApiError>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match self.sub.try_next() {
                Next::Event(Event::Error { code, message }, _) => {
                    self.ended = true;
                    return Some(Err(ApiError::new(code, message)));
                }
                Next::Event(ev, body) => {
                    if ev.is_terminal() {
                        self.ended = true;
                    }
                    return Some(Ok((ev, body)));
                }
                Next::Ended => {
                    self.ended = true;
                    return Some(Err(ApiError::new(
                        ErrorCode::AgentUnavailable,
                        "the sandbox's agent stopped answering this stream",
                    )));
                }
                Next::Empty => {}
            }
            let now = tokio::time::Instant::now();
            if now >= deadline || self.ended {
                return None;
            }
            let slice = SLICE.min(deadline - now);
            let pumped = with_sandbox(&self.app, &self.entry, move |_, sb| {
                sb.agent().pump(slice).map_err(ApiError::from)
            })
            .await;
            if let Err(e) = pumped {
                self.ended = true;
                return Some(Err(e));
            }
        }
    }

    /// Stops following (the process or watch goes on, ended on the agent's side).
    pub(super) async fn detach(self) {
        if self.ended {
            return;
        }
        let id = self.sub.id();
        let _ = with_sandbox(&self.app, &self.entry, move |_, sb| {
            sb.agent().unsubscribe(id);
            Ok(())
        })
        .await;
    }
}
