//! Trajectories through the gateway. A trajectory's log lives on the node whose sandboxes ran
//! its steps, and its id is the client's (not one that names a node), so the gateway finds its
//! node by asking: every live node at once, the first that knows it answers, and the gateway
//! remembers the answer (per tenant: trajectory ids are) for the calls that follow. The list is
//! every node's, merged (the gateway's one fan-out).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::Response;

use super::{call_json, forward, nodes, problem, tenant_of, App};

/// Most trajectory → node answers a gateway remembers (then it forgets them all and asks
/// again: an answer costs one round of calls).
const REMEMBERED: usize = 100_000;

/// `/v1/trajectories/{id}` and everything under it: forwarded to the node that holds it.
pub(super) async fn by_id(State(gw): State<App>, req: Request) -> Response {
    let tid = req
        .uri()
        .path()
        .trim_start_matches("/v1/trajectories/")
        .split('/')
        .next()
        .unwrap_or("")
        .to_owned();
    // Per tenant: trajectory ids are.
    let key = format!("{}/{tid}", tenant_of(&gw, req.headers()).0);
    let known = {
        let m = gw.trajectories.lock().unwrap_or_else(|p| p.into_inner());
        m.get(&key).cloned()
    };
    let live = nodes(&gw);
    let node = match known.and_then(|name| live.iter().find(|n| n.name == name).cloned()) {
        Some(n) => Some(n),
        None => {
            let path = format!("/v1/trajectories/{tid}");
            let asks = live.iter().map(|n| {
                let (gw, h, path) = (Arc::clone(&gw), req.headers().clone(), path.clone());
                async move {
                    let (s, _) = call_json(&gw, n, Method::GET, &path, &h, Vec::new()).await;
                    (s, n)
                }
            });
            let answers = futures_util::future::join_all(asks).await;
            let found = answers
                .into_iter()
                .find(|(s, _)| s.is_success())
                .map(|(_, n)| n.clone());
            if let Some(n) = &found {
                let mut m = gw.trajectories.lock().unwrap_or_else(|p| p.into_inner());
                if m.len() >= REMEMBERED {
                    m.clear();
                }
                m.insert(key, n.name.clone());
            }
            found
        }
    };
    match node {
        Some(n) => forward(&gw, &n, req).await,
        None => problem(
            StatusCode::NOT_FOUND,
            "trajectory_not_found",
            &format!("no node holds trajectory {tid}"),
        ),
    }
}
