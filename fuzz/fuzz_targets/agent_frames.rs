//! Fuzzes the agent frame decoder with arbitrary byte streams split at arbitrary points:
//! decoding must never panic, never allocate beyond the frame bounds, and the incremental decoder
//! must agree with the blocking reader.
#![no_main]

use dsec_api::frame::{read_frame, FrameDecoder, MAX_BODY, MAX_HEADER};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(1, |b| usize::from(*b).max(1));
    let mut dec = FrameDecoder::new();
    let mut from_decoder = Vec::new();
    for chunk in data.chunks(split) {
        dec.push(chunk);
        loop {
            match dec.next_frame() {
                Ok(Some(frame)) => {
                    assert!(frame.header.len() <= MAX_HEADER && frame.body.len() <= MAX_BODY);
                    let _ = frame.clone().into_request();
                    let _ = frame.clone().into_event();
                    from_decoder.push(frame);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let mut reader = data;
    for expected in from_decoder {
        match read_frame(&mut reader) {
            Ok(Some(frame)) => assert_eq!(frame, expected),
            other => panic!("blocking reader disagrees: {other:?}"),
        }
    }
});
