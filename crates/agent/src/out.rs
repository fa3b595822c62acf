//! The writing half of the agent's connection: one mutex-guarded writer, so frames of the
//! threads answering requests never interleave.

use std::io::{self, Write};
use std::sync::Mutex;

use dsec_api::agent::Event;
use dsec_api::error::chain;
use dsec_api::exec::ExecResult;
use dsec_api::frame::{self, FrameError};
use dsec_api::ErrorCode;

use crate::reaper::lock;

/// The writing half of the connection.
pub struct Out {
    pub(crate) w: Mutex<Box<dyn Write + Send>>,
}

impl Out {
    /// Sends one event frame; transport errors are ignored (the reader sees the hang-up).
    pub fn send(&self, id: u64, ev: &Event, body: &[u8]) {
        match frame::encode_event(id, ev, body) {
            Ok(bytes) => {
                let mut w = lock(&self.w);
                let _ = w.write_all(&bytes);
            }
            Err(FrameError::HeaderTooLarge(_)) if matches!(ev, Event::ExecDone(_)) => {
                // Captured output that JSON-escapes beyond the frame limit (1 MiB of NUL bytes
                // is 6 MiB of `\u0000`): keep less of it, marked truncated, rather than answer
                // nothing.
                if let Event::ExecDone(r) = ev {
                    let mut r = r.clone();
                    if shrink_output(&mut r) {
                        self.send(id, &Event::ExecDone(r), body);
                        return;
                    }
                }
                self.error(
                    id,
                    ErrorCode::Internal,
                    &io::Error::other("exec result too large to send"),
                );
            }
            Err(e) => {
                eprintln!("dsec-agent: encode event for request {id}: {e}");
                // Never leave the host waiting for an answer that will not come.
                if !matches!(ev, Event::Error { .. }) {
                    self.error(id, ErrorCode::Internal, &e);
                }
            }
        }
    }

    /// Answers with the `Data` events `read` passes its pieces to (`send(bytes, eof)`), or with
    /// its error and the code `code` gives it.
    pub(crate) fn send_data<E: std::error::Error>(
        &self,
        id: u64,
        code: fn(&E) -> ErrorCode,
        read: impl FnOnce(&mut dyn FnMut(&[u8], bool)) -> Result<(), E>,
    ) {
        let mut send = |b: &[u8], eof: bool| self.send(id, &Event::Data { eof }, b);
        if let Err(e) = read(&mut send) {
            self.error(id, code(&e), &e);
        }
    }

    /// Answers with an `Error` event.
    pub(crate) fn error(&self, id: u64, code: ErrorCode, err: &dyn std::error::Error) {
        let message = chain(err);
        self.send(id, &Event::Error { code, message }, &[]);
    }
}

/// Halves the kept bytes of the larger captured stream (head and tail halves kept); false when
/// there is nothing left to drop.
fn shrink_output(r: &mut ExecResult) -> bool {
    let c = if r.stdout.data.len() >= r.stderr.data.len() {
        &mut r.stdout
    } else {
        &mut r.stderr
    };
    let len = c.data.len();
    if len < 64 {
        return false;
    }
    let keep = len / 2;
    let head = keep / 2;
    let tail = keep - head;
    let mut data = Vec::with_capacity(keep);
    data.extend_from_slice(&c.data[..head]);
    data.extend_from_slice(&c.data[len - tail..]);
    c.data = data;
    c.truncated = true;
    true
}
