//! Host-side client of the `dsec-agent` protocol (the same for every substrate).
//!
//! Blocking and one request at a time per connection: a sandbox's operations are serialised by
//! its owner. Every wait is bounded by a deadline.
//!
//! Requests that go on while others are made — a streaming `Spawn`, a `ProcAttach`, a `Watch` —
//! are *subscriptions* ([`AgentConn::subscribe`]): every read of the connection (a
//! [`AgentConn::call`], or [`AgentConn::pump`] between calls) routes their events into the
//! subscription's channel instead of dropping them. A subscription whose reader falls behind
//! by more than [`SUBSCRIPTION_MAX_BYTES`] is ended (see [`AgentConn::subscribe`]).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use dsec_api::agent::{Event, Request, PROTOCOL_VERSION};
use dsec_api::exec::{ExecRequest, ExecResult, Stream};
use dsec_api::frame::{self, FrameDecoder, FrameError};
use dsec_api::ErrorCode;

/// Errors talking to an agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The transport failed or the agent closed it.
    #[error("agent connection lost")]
    Disconnected(#[source] io::Error),
    /// The agent did not answer within the deadline.
    #[error("agent did not answer within {0:?}")]
    Timeout(Duration),
    /// A frame could not be encoded or decoded.
    #[error("agent protocol error")]
    Protocol(#[source] FrameError),
    /// The agent answered with an unexpected event.
    #[error("unexpected agent event {0}")]
    Unexpected(String),
    /// The agent reported a failure.
    #[error("agent: {code}: {message}")]
    Remote {
        /// Stable code.
        code: ErrorCode,
        /// Detail.
        message: String,
    },
}

impl AgentError {
    /// The stable code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            AgentError::Remote { code, .. } => *code,
            AgentError::Timeout(_) => ErrorCode::ExecTimeout,
            AgentError::Disconnected(_) | AgentError::Protocol(_) | AgentError::Unexpected(_) => {
                ErrorCode::AgentUnavailable
            }
        }
    }

    /// A timeout says the whole wait, `limit`, not what was left of it at the last read.
    fn waited(self, limit: Duration) -> Self {
        match self {
            AgentError::Timeout(_) => AgentError::Timeout(limit),
            other => other,
        }
    }
}

/// Grace added to a request's own timeout before the connection is declared dead.
const DEADLINE_SLACK: Duration = Duration::from_secs(5);
/// Deadline of requests that carry no timeout of their own.
/// Most bytes [`AgentConn::reattach`] reads before the greeting.
pub const RESYNC_MAX: usize = 64 << 20;
const DEFAULT_DEADLINE: Duration = Duration::from_secs(60);
/// Bytes one read takes from the socket, into a buffer on the caller's stack: a node holds
/// thousands of connections, and a buffer per connection would be that many dirty pages.
const READ_CHUNK: usize = 32 << 10;

/// Most bytes of events a subscription holds that its reader has not taken; past it the
/// subscription is ended with a `resource_exhausted` error.
pub const SUBSCRIPTION_MAX_BYTES: usize = 16 << 20;
/// What each event counts against [`SUBSCRIPTION_MAX_BYTES`] besides its body.
const EVENT_COST: usize = 256;

/// A connection to one agent.
#[derive(Debug)]
pub struct AgentConn {
    stream: UnixStream,
    decoder: FrameDecoder,
    next_id: u64,
    greeted: bool,
    /// Added to a request's own timeout: the window of silence after which the agent's
    /// liveness is probed (see [`AgentConn::call`]).
    slack: Duration,
    /// Live subscriptions by request id.
    subs: HashMap<u64, Routed>,
}

/// The connection's side of a subscription.
#[derive(Debug)]
struct Routed {
    tx: mpsc::UnboundedSender<(Event, Vec<u8>)>,
    /// Bytes sent into the channel and not yet taken (shared with the [`Subscription`]).
    pending: Arc<AtomicUsize>,
    /// What ends it early.
    cancel: Cancel,
}

/// How a subscription is ended before its terminal event.
#[derive(Debug, Clone, Copy)]
enum Cancel {
    /// A process follower: `ProcDetach` once its handle is known (from `Attached`).
    Process(Option<u64>),
    /// A `Watch`: `Unwatch`.
    Watch,
    /// Nothing to send (a request that ends by itself).
    None,
}

/// The receiving end of a subscription: the events of one request, the terminal one last.
#[derive(Debug)]
pub struct Subscription {
    id: u64,
    rx: mpsc::UnboundedReceiver<(Event, Vec<u8>)>,
    pending: Arc<AtomicUsize>,
}

/// What [`Subscription::try_next`] found.
#[derive(Debug)]
pub enum Next {
    /// An event and its body.
    Event(Event, Vec<u8>),
    /// Nothing yet.
    Empty,
    /// No more will come: the terminal event was taken, or the connection dropped it.
    Ended,
}

impl Subscription {
    /// The id of the request it follows.
    pub fn id(&self) -> u64 {
        self.id
    }

    fn took(&self, item: &(Event, Vec<u8>)) {
        self.pending
            .fetch_sub(item.1.len() + EVENT_COST, Ordering::AcqRel);
    }

    /// The next event if one was routed, without waiting.
    pub fn try_next(&mut self) -> Next {
        match self.rx.try_recv() {
            Ok(item) => {
                self.took(&item);
                Next::Event(item.0, item.1)
            }
            Err(mpsc::error::TryRecvError::Empty) => Next::Empty,
            Err(mpsc::error::TryRecvError::Disconnected) => Next::Ended,
        }
    }

    /// Waits for the next event (someone else must read the connection meanwhile: a
    /// [`AgentConn::call`] or [`AgentConn::pump`]); `None` once it ended.
    pub async fn recv(&mut self) -> Option<(Event, Vec<u8>)> {
        let item = self.rx.recv().await?;
        self.took(&item);
        Some(item)
    }
}

impl AgentConn {
    /// Wraps a connected agent socket.
    pub fn new(fd: OwnedFd) -> Self {
        Self {
            stream: UnixStream::from(fd),
            decoder: FrameDecoder::new(),
            next_id: 1,
            greeted: false,
            slack: DEADLINE_SLACK,
            subs: HashMap::new(),
        }
    }

    /// Wraps the socket of an agent that an earlier node process talked to: its greeting was
    /// consumed then, and request ids start at the current time in microseconds since the
    /// epoch, above anything an earlier process could have used (they started lower and take
    /// far fewer than one id per microsecond), so a late answer to one of their requests is
    /// never taken for an answer to ours.
    pub fn adopted(fd: OwnedFd) -> Self {
        let mut c = Self::new(fd);
        c.greeted = true;
        c.next_id = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1 << 50, |d| d.as_micros() as u64);
        c
    }

    /// Re-attaches to a VM guest's agent after the node restarted: the guest greets every new
    /// connection with `Hello`, but the byte stream may begin with the rest of a frame cut by
    /// the disconnect. Bytes are skipped until a whole `Hello` frame decodes; what follows it
    /// is the connection's stream. Fails at `timeout` or when more than [`RESYNC_MAX`] bytes
    /// arrive without a greeting.
    pub fn reattach(fd: OwnedFd, timeout: Duration) -> Result<Self, AgentError> {
        let mut c = Self::adopted(fd);
        let deadline = Instant::now() + timeout;
        let mut pending: Vec<u8> = Vec::new();
        let prefix = [frame::MAGIC[0], frame::MAGIC[1], PROTOCOL_VERSION, 1];
        loop {
            let mut start = 0;
            while let Some(off) = pending[start..].windows(4).position(|w| w == prefix) {
                let pos = start + off;
                let mut dec = FrameDecoder::new();
                dec.push(&pending[pos..]);
                if let Ok(Some(raw)) = dec.next_frame() {
                    if let Ok((env, _)) = raw.into_event() {
                        if let Event::Hello { version, .. } = env.ev {
                            if version != PROTOCOL_VERSION {
                                return Err(AgentError::Unexpected(format!(
                                    "agent protocol version {version}"
                                )));
                            }
                            c.decoder = dec;
                            return Ok(c);
                        }
                    }
                }
                // Garbage, a late answer, or a frame that is not complete yet (perhaps a
                // bogus length): look further.
                start = pos + 1;
            }
            if pending.len() > RESYNC_MAX {
                return Err(AgentError::Unexpected(
                    "no greeting from the agent after a reconnect".into(),
                ));
            }
            let mut chunk = [0u8; READ_CHUNK];
            let n = c
                .read_some(deadline, &mut chunk)
                .map_err(|e| e.waited(timeout))?;
            pending.extend_from_slice(&chunk[..n]);
        }
    }

    /// The next event that is not a subscription's (those are routed on the way).
    fn read_event(&mut self, deadline: Instant) -> Result<(u64, Event, Vec<u8>), AgentError> {
        loop {
            if let Some(got) = self.read_routed(deadline)? {
                return Ok(got);
            }
        }
    }

    /// Reads one event: a subscription's is routed into its channel (`None`), any other is
    /// returned.
    fn read_routed(
        &mut self,
        deadline: Instant,
    ) -> Result<Option<(u64, Event, Vec<u8>)>, AgentError> {
        loop {
            if let Some(raw) = self.decoder.next_frame().map_err(AgentError::Protocol)? {
                let (env, body) = raw.into_event().map_err(AgentError::Protocol)?;
                if self.subs.contains_key(&env.id) {
                    self.route(env.id, env.ev, body);
                    return Ok(None);
                }
                return Ok(Some((env.id, env.ev, body)));
            }
            let mut chunk = [0u8; READ_CHUNK];
            let n = self.read_some(deadline, &mut chunk)?;
            self.decoder.push(&chunk[..n]);
        }
    }

    /// Passes an event to subscription `id`: a terminal one ends it; one past the memory
    /// bound ends it with an error and stops the following at the agent; a reader that went
    /// away ends it the same way.
    fn route(&mut self, id: u64, ev: Event, body: Vec<u8>) {
        let Some(sub) = self.subs.get_mut(&id) else {
            return;
        };
        if let (Event::Attached { handle, .. }, Cancel::Process(h)) = (&ev, &mut sub.cancel) {
            *h = Some(*handle);
        }
        let terminal = ev.is_terminal();
        let cost = body.len() + EVENT_COST;
        let over = sub.pending.load(Ordering::Acquire) + cost > SUBSCRIPTION_MAX_BYTES;
        if over && !terminal {
            let _ = sub.tx.send((
                Event::Error {
                    code: ErrorCode::ResourceExhausted,
                    message: format!(
                        "the follower fell more than {SUBSCRIPTION_MAX_BYTES} bytes behind"
                    ),
                },
                Vec::new(),
            ));
            self.cancel(id);
            return;
        }
        sub.pending.fetch_add(cost, Ordering::AcqRel);
        let gone = sub.tx.send((ev, body)).is_err();
        if terminal {
            self.subs.remove(&id);
        } else if gone {
            self.cancel(id);
        }
    }

    /// Ends subscription `id` and asks the agent to stop what feeds it (its answer, and the
    /// subscription's own end, arrive later and are dropped as events of no one's).
    fn cancel(&mut self, id: u64) {
        let Some(sub) = self.subs.remove(&id) else {
            return;
        };
        let req = match sub.cancel {
            Cancel::Process(Some(handle)) => Request::ProcDetach { handle, attach: id },
            Cancel::Watch => Request::Unwatch { watch: id },
            Cancel::Process(None) | Cancel::None => return,
        };
        if let Err(e) = self.send(&req, &[]) {
            tracing::debug!(request = id, error = %e, "stop a follower");
        }
    }

    /// Sends `req` as a subscription: its events, up to and including the terminal one, go to
    /// the returned [`Subscription`] as any read of this connection comes across them. Meant
    /// for a streaming `Spawn`, a `ProcAttach` and a `Watch` (their ends: [`AgentConn::unsubscribe`]);
    /// any request works. Returns the request's id.
    pub fn subscribe(
        &mut self,
        req: &Request,
        body: &[u8],
    ) -> Result<(u64, Subscription), AgentError> {
        let cancel = match req {
            Request::ProcAttach { handle } => Cancel::Process(Some(*handle)),
            Request::Spawn(r) if r.stream => Cancel::Process(None),
            Request::Watch { .. } => Cancel::Watch,
            Request::AsUser { req, .. } if matches!(**req, Request::Watch { .. }) => Cancel::Watch,
            _ => Cancel::None,
        };
        let id = self.send(req, body)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let pending = Arc::new(AtomicUsize::new(0));
        self.subs.insert(
            id,
            Routed {
                tx,
                pending: Arc::clone(&pending),
                cancel,
            },
        );
        Ok((id, Subscription { id, rx, pending }))
    }

    /// Ends subscription `id` early: `ProcDetach` (a process's follower) or `Unwatch` (a watch)
    /// is sent; what arrives for it afterwards is dropped. Nothing when it already ended.
    pub fn unsubscribe(&mut self, id: u64) {
        self.cancel(id);
    }

    /// Reads and routes what the agent sends for up to `max_wait`, returning once something
    /// was routed to a subscription (and what had already arrived with it) — or at once when
    /// there is no subscription. Events of no subscription are dropped (no request is
    /// outstanding between calls). True when something was routed.
    pub fn pump(&mut self, max_wait: Duration) -> Result<bool, AgentError> {
        let mut deadline = Instant::now() + max_wait;
        let mut routed = false;
        while !self.subs.is_empty() {
            match self.read_routed(deadline) {
                Ok(None) => {
                    routed = true;
                    // Only what is buffered already.
                    deadline = Instant::now();
                }
                Ok(Some((_, Event::Hello { version, .. }, _))) => {
                    if version != PROTOCOL_VERSION {
                        return Err(AgentError::Unexpected(format!(
                            "agent protocol version {version}"
                        )));
                    }
                    self.greeted = true;
                }
                Ok(Some(_)) => {}
                Err(AgentError::Timeout(_)) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(routed)
    }

    /// How many subscriptions are live.
    pub fn subscriptions(&self) -> usize {
        self.subs.len()
    }

    /// Reads what the agent sent into `buf` (waiting until `deadline`); returns how many
    /// bytes (0 after an interrupted read). End of stream is `Disconnected`.
    fn read_some(&mut self, deadline: Instant, buf: &mut [u8]) -> Result<usize, AgentError> {
        let now = Instant::now();
        if now >= deadline {
            return Err(AgentError::Timeout(Duration::ZERO));
        }
        self.stream
            .set_read_timeout(Some(deadline - now))
            .map_err(AgentError::Disconnected)?;
        match self.stream.read(buf) {
            Ok(0) => Err(AgentError::Disconnected(io::Error::from(
                io::ErrorKind::UnexpectedEof,
            ))),
            Ok(n) => Ok(n),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(AgentError::Timeout(Duration::ZERO))
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
            Err(e) => Err(AgentError::Disconnected(e)),
        }
    }

    fn send(&mut self, req: &Request, body: &[u8]) -> Result<u64, AgentError> {
        let id = self.next_id;
        self.next_id += 1;
        let bytes = frame::encode_request(id, req, body).map_err(AgentError::Protocol)?;
        self.stream
            .write_all(&bytes)
            .map_err(AgentError::Disconnected)?;
        Ok(id)
    }

    /// Sends a request and collects events until the terminal one. `on_event` sees every
    /// non-terminal event (output chunks, data chunks) with its body.
    ///
    /// The wait is bounded by the agent's liveness, not by wall time: a request's own timeout
    /// (a command's, which the agent enforces from the command's start) plus a slack, or 60 s
    /// without one, is a window of silence. When a window passes without a frame, the agent is
    /// pinged (it answers pings on its reading thread while the request runs) and the wait goes
    /// on while frames keep coming; only a whole window without any answer after the ping is a
    /// timeout. So a request that waited for a CPU, or for its agent to be scheduled, before it
    /// started does not fail while its own deadline has not passed.
    pub fn call(
        &mut self,
        req: &Request,
        body: &[u8],
        timeout: Option<Duration>,
        mut on_event: impl FnMut(&Event, &[u8]),
    ) -> Result<(Event, Vec<u8>), AgentError> {
        let id = self.send(req, body)?;
        let limit = timeout.map_or(DEFAULT_DEADLINE, |t| t + self.slack);
        let mut deadline = Instant::now() + limit;
        // The outstanding liveness ping, if any (never for a ping: that is the probe itself).
        let mut probe: Option<u64> = None;
        loop {
            let (rid, ev, body) = match self.read_routed(deadline) {
                Ok(Some(got)) => got,
                // A subscription's event: the agent is alive.
                Ok(None) => {
                    deadline = Instant::now() + limit;
                    continue;
                }
                Err(AgentError::Timeout(_)) if probe.is_none() && !matches!(req, Request::Ping) => {
                    probe = Some(self.send(&Request::Ping, &[])?);
                    deadline = Instant::now() + limit;
                    continue;
                }
                Err(e) => return Err(e.waited(limit)),
            };
            // Any frame shows the agent alive: a new window begins.
            deadline = Instant::now() + limit;
            if Some(rid) == probe {
                probe = None;
                continue;
            }
            if rid != id {
                if let Event::Hello { version, .. } = ev {
                    // A request may be pipelined behind the agent's greeting (see `create`).
                    if version != PROTOCOL_VERSION {
                        return Err(AgentError::Unexpected(format!(
                            "agent protocol version {version}"
                        )));
                    }
                    self.greeted = true;
                }
                continue; // a late event of an abandoned request
            }
            if ev.is_terminal() {
                if let Event::Error { code, message } = ev {
                    return Err(AgentError::Remote { code, message });
                }
                return Ok((ev, body));
            }
            on_event(&ev, &body);
        }
    }

    /// Whether the agent's `Hello` was seen.
    pub fn greeted(&self) -> bool {
        self.greeted
    }

    /// Waits for the terminal answer to a request someone else sent on this connection with
    /// id `id` (the supervisor, during a reset); it must be `Ok`.
    pub fn await_reply(&mut self, id: u64, timeout: Duration) -> Result<(), AgentError> {
        let deadline = Instant::now() + timeout;
        loop {
            let (rid, ev, _) = self.read_event(deadline).map_err(|e| e.waited(timeout))?;
            if let Event::Hello { version, .. } = ev {
                if version != PROTOCOL_VERSION {
                    return Err(AgentError::Unexpected(format!(
                        "agent protocol version {version}"
                    )));
                }
                self.greeted = true;
                continue;
            }
            if rid != id || !ev.is_terminal() {
                continue;
            }
            return match ev {
                Event::Ok => Ok(()),
                Event::Error { code, message } => Err(AgentError::Remote { code, message }),
                other => Err(AgentError::Unexpected(format!("{other:?}"))),
            };
        }
    }

    /// Liveness check.
    pub fn ping(&mut self) -> Result<(), AgentError> {
        self.ping_within(Duration::from_secs(5))
    }

    /// Liveness check with a chosen timeout (a VM's first answer comes at the end of its boot).
    pub fn ping_within(&mut self, timeout: Duration) -> Result<(), AgentError> {
        match self.call(&Request::Ping, &[], Some(timeout), |_, _| {})?.0 {
            Event::Pong => Ok(()),
            other => Err(AgentError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Runs a command to completion; `on_output` receives streamed chunks when `req.stream`.
    pub fn exec(
        &mut self,
        req: &ExecRequest,
        stdin: &[u8],
        mut on_output: impl FnMut(Stream, &[u8]),
    ) -> Result<ExecResult, AgentError> {
        let timeout = req.timeout_ms.map(Duration::from_millis);
        let (ev, _) = self.call(&Request::Exec(req.clone()), stdin, timeout, |ev, body| {
            if let Event::Output { stream } = ev {
                on_output(*stream, body);
            }
        })?;
        match ev {
            Event::ExecDone(r) => Ok(r),
            other => Err(AgentError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Sends a request whose answer is `Ok`.
    pub fn call_ok(&mut self, req: &Request, body: &[u8]) -> Result<(), AgentError> {
        match self.call(req, body, None, |_, _| {})?.0 {
            Event::Ok => Ok(()),
            other => Err(AgentError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Sends a request answered by `Data` chunks and concatenates them, up to `max_bytes`
    /// (a misbehaving agent cannot grow the node's memory beyond it).
    pub fn call_data(&mut self, req: &Request, max_bytes: usize) -> Result<Vec<u8>, AgentError> {
        let mut out = Vec::new();
        let mut overflow = false;
        let (ev, last) = self.call(req, &[], None, |ev, body| {
            if let Event::Data { .. } = ev {
                if out.len() + body.len() > max_bytes {
                    overflow = true;
                } else {
                    out.extend_from_slice(body);
                }
            }
        })?;
        if overflow || out.len() + last.len() > max_bytes {
            return Err(AgentError::Remote {
                code: ErrorCode::TooLarge,
                message: format!("answer exceeds {max_bytes} bytes"),
            });
        }
        match ev {
            Event::Data { eof: true } => {
                out.extend_from_slice(&last);
                Ok(out)
            }
            other => Err(AgentError::Unexpected(format!("{other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> anyhow::Result<(AgentConn, UnixStream, UnixStream)> {
        let (node, agent) = UnixStream::pair()?;
        let dup = node.try_clone()?;
        Ok((AgentConn::new(dup.into()), node, agent))
    }

    #[test]
    fn reattach_skips_a_cut_frame_and_late_answers() -> anyhow::Result<()> {
        let (_unused, node, mut agent) = pair()?;
        let late = frame::encode_event(7, &Event::Pong, &[])?;
        let hello = frame::encode_event(
            0,
            &Event::Hello {
                version: PROTOCOL_VERSION,
                pid: 1,
            },
            &[],
        )?;
        let next = frame::encode_event(u64::MAX, &Event::Ok, &[])?;
        // the tail of a frame cut by the disconnect, a frame prefix claiming a huge body, a
        // whole late answer, then the greeting and what follows it
        let mut bytes = late[5..].to_vec();
        bytes.extend_from_slice(&[
            b'D',
            b'S',
            PROTOCOL_VERSION,
            1,
            0,
            0,
            0,
            1,
            0xff,
            0xff,
            0xff,
            0x01,
        ]);
        bytes.extend_from_slice(&late);
        bytes.extend_from_slice(&hello);
        bytes.extend_from_slice(&next);
        agent.write_all(&bytes)?;
        let mut c = AgentConn::reattach(node.into(), Duration::from_secs(5))?;
        assert!(c.greeted());
        let (id, ev, _) = c.read_event(Instant::now() + Duration::from_secs(5))?;
        assert_eq!((id, ev), (u64::MAX, Event::Ok));
        Ok(())
    }

    /// A fake agent on `agent`: answers every ping at once, and the request `first` (the one
    /// read first) with `ExecDone` only after it answered `pings` pings: an agent that is
    /// alive but whose command has not finished (waiting for a CPU or a lock).
    fn slow_agent(mut agent: UnixStream, pings: usize) -> std::thread::JoinHandle<usize> {
        std::thread::spawn(move || {
            let mut first = None;
            let mut answered = 0;
            while let Ok(Some(raw)) = frame::read_frame(&mut agent) {
                let Ok((env, _)) = raw.into_request() else {
                    break;
                };
                let reply = match env.req {
                    Request::Ping => {
                        answered += 1;
                        frame::encode_event(env.id, &Event::Pong, &[])
                    }
                    _ => {
                        first = Some(env.id);
                        continue;
                    }
                };
                let Ok(bytes) = reply else { break };
                if agent.write_all(&bytes).is_err() {
                    break;
                }
                if let (Some(id), true) = (first, answered == pings) {
                    let done = ExecResult {
                        status: dsec_api::exec::ExecStatus::Ok,
                        exit_code: Some(0),
                        signal: None,
                        wall_us: 1,
                        cpu_us: 0,
                        peak_rss_kb: 0,
                        stdout: Default::default(),
                        stderr: Default::default(),
                    };
                    let Ok(bytes) = frame::encode_event(id, &Event::ExecDone(done), &[]) else {
                        break;
                    };
                    if agent.write_all(&bytes).is_err() {
                        break;
                    }
                }
            }
            answered
        })
    }

    #[test]
    fn an_exec_outlasting_its_window_succeeds_while_the_agent_answers_pings() -> anyhow::Result<()>
    {
        let (spare, node, agent) = pair()?;
        let fake = slow_agent(agent, 3);
        let mut c = AgentConn::new(node.into());
        c.slack = Duration::from_millis(20);
        let mut req = ExecRequest::argv(["/bin/true"]);
        req.timeout_ms = Some(1);
        // The answer comes after three windows of silence, each ended by a ping the agent
        // answered: the exec's deadline (the agent's, from the command's start) never passed
        // for the node, which waits while the agent is alive.
        let r = c.exec(&req, &[], |_, _| {})?;
        assert_eq!(r.exit_code, Some(0));
        // Both node ends closed: the fake agent sees the end of the stream.
        drop((c, spare));
        assert_eq!(fake.join().ok(), Some(3));
        Ok(())
    }

    #[test]
    fn a_silent_agent_times_out_after_an_unanswered_ping() -> anyhow::Result<()> {
        let (spare, node, mut agent) = pair()?;
        let mut c = AgentConn::new(node.into());
        c.slack = Duration::from_millis(20);
        let mut req = ExecRequest::argv(["/bin/true"]);
        req.timeout_ms = Some(1);
        let Err(e) = c.exec(&req, &[], |_, _| {}) else {
            panic!("no timeout")
        };
        assert!(matches!(e, AgentError::Timeout(d) if d == Duration::from_millis(21)));
        drop((c, spare));
        // The node sent the exec, then one ping.
        let kinds: Vec<bool> = (0..2)
            .map(|_| {
                frame::read_frame(&mut agent)
                    .ok()
                    .flatten()
                    .and_then(|raw| raw.into_request().ok())
                    .is_some_and(|(env, _)| matches!(env.req, Request::Ping))
            })
            .collect();
        assert_eq!(kinds, [false, true]);
        Ok(())
    }

    fn event(id: u64, ev: &Event, body: &[u8]) -> anyhow::Result<Vec<u8>> {
        Ok(frame::encode_event(id, ev, body)?)
    }

    fn next_request(agent: &mut UnixStream) -> anyhow::Result<(u64, Request)> {
        let raw = frame::read_frame(agent)?.ok_or_else(|| anyhow::anyhow!("eof"))?;
        let (env, _) = raw.into_request()?;
        Ok((env.id, env.req))
    }

    #[test]
    fn calls_route_a_subscriptions_events_and_pump_reads_between_calls() -> anyhow::Result<()> {
        let (_spare, node, mut agent) = pair()?;
        let mut c = AgentConn::new(node.into());
        let (id, mut sub) = c.subscribe(&Request::ProcAttach { handle: 4 }, &[])?;
        assert_eq!(sub.id(), id);
        assert!(matches!(sub.try_next(), Next::Empty));
        let (rid, req) = next_request(&mut agent)?;
        assert_eq!((rid, req), (id, Request::ProcAttach { handle: 4 }));
        // The follower's events come before, among and after a call's answer.
        let fake = std::thread::spawn(move || -> anyhow::Result<UnixStream> {
            let (ping, _) = next_request(&mut agent)?;
            let mut bytes = event(id, &Event::Attached { handle: 4, pid: 9 }, &[])?;
            bytes.extend(event(
                id,
                &Event::Output {
                    stream: Stream::Stdout,
                },
                b"one",
            )?);
            bytes.extend(event(ping, &Event::Pong, &[])?);
            bytes.extend(event(
                id,
                &Event::Output {
                    stream: Stream::Stdout,
                },
                b"two",
            )?);
            agent.write_all(&bytes)?;
            Ok(agent)
        });
        c.ping()?;
        let mut agent = fake
            .join()
            .map_err(|_| anyhow::anyhow!("fake agent panicked"))??;
        let mut got = Vec::new();
        while let Next::Event(ev, body) = sub.try_next() {
            got.push((ev, body));
        }
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].0, Event::Attached { handle: 4, pid: 9 });
        assert_eq!(got[1].1, b"one");
        // Between calls, a pump reads the rest; the terminal event ends the subscription.
        assert!(c.pump(Duration::from_secs(5))?);
        assert!(matches!(sub.try_next(), Next::Event(_, b) if b == b"two"));
        agent.write_all(&event(id, &Event::Detached, &[])?)?;
        assert!(c.pump(Duration::from_secs(5))?);
        assert!(matches!(sub.try_next(), Next::Event(Event::Detached, _)));
        assert!(matches!(sub.try_next(), Next::Ended));
        assert_eq!(c.subscriptions(), 0);
        // No subscription: a pump returns at once.
        let t = Instant::now();
        assert!(!c.pump(Duration::from_secs(5))?);
        assert!(t.elapsed() < Duration::from_secs(1));
        Ok(())
    }

    #[test]
    fn a_subscription_falling_too_far_behind_is_ended_and_detached() -> anyhow::Result<()> {
        let (spare, node, mut agent) = pair()?;
        let mut c = AgentConn::new(node.into());
        let mut req = ExecRequest::argv(["yes"]);
        req.stream = true;
        let (id, mut sub) = c.subscribe(&Request::Spawn(req), &[])?;
        next_request(&mut agent)?;
        let mut requests = agent.try_clone()?;
        let chunk = vec![b'y'; 256 << 10];
        // Writes until the node end closes (a write error ends it).
        let writer = std::thread::spawn(move || {
            let attached = event(id, &Event::Attached { handle: 7, pid: 9 }, &[]);
            let output = event(
                id,
                &Event::Output {
                    stream: Stream::Stdout,
                },
                &chunk,
            );
            if let (Ok(a), Ok(o)) = (attached, output) {
                if agent.write_all(&a).is_ok() {
                    while agent.write_all(&o).is_ok() {}
                }
            }
        });
        while c.subscriptions() > 0 {
            c.pump(Duration::from_secs(5))?;
        }
        // The node asked the agent to stop the following …
        let (_, stop) = next_request(&mut requests)?;
        assert_eq!(
            stop,
            Request::ProcDetach {
                handle: 7,
                attach: id
            }
        );
        drop((c, spare));
        writer
            .join()
            .map_err(|_| anyhow::anyhow!("writer panicked"))?;
        // … and the reader finds what fit, then the error.
        let mut last = None;
        let mut bytes = 0;
        while let Next::Event(ev, body) = sub.try_next() {
            bytes += body.len();
            last = Some(ev);
        }
        assert!(bytes > 0 && bytes <= SUBSCRIPTION_MAX_BYTES, "{bytes}");
        assert!(
            matches!(
                last,
                Some(Event::Error {
                    code: ErrorCode::ResourceExhausted,
                    ..
                })
            ),
            "{last:?}"
        );
        assert!(matches!(sub.try_next(), Next::Ended));
        Ok(())
    }

    #[test]
    fn reattach_without_greeting_times_out() -> anyhow::Result<()> {
        let (_unused, node, mut agent) = pair()?;
        agent.write_all(b"DS\x01\x01garbage")?;
        let r = AgentConn::reattach(node.into(), Duration::from_millis(200));
        // The error names the whole wait (it used to say "within 0ns").
        let Err(e) = r else { panic!("no timeout") };
        assert!(matches!(e, AgentError::Timeout(d) if d == Duration::from_millis(200)));
        assert_eq!(e.to_string(), "agent did not answer within 200ms");
        Ok(())
    }
}
