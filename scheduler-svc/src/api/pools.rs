//! AdminService's warm-pool calls, ListPools and SetPool ([`crate::drive::pools`]):
//! the gRPC service in [`super::grpc`] hands them here; the JSON routes reach them through it.

use antidote_proto::api::v1 as api;
use tonic::{Request, Response, Status};

use super::Api;
use super::convert as wire;
use crate::drive::pools::PoolView;
use crate::error::Error;
use crate::model::{PoolWindow, clock_time};
use crate::settings::Scope;

/// Longest audit target kept from a request (a slug is at most 128 characters anyway).
const MAX_TARGET: usize = 160;

/// AdminService.ListPools (admin:read).
pub(super) async fn list_pools(
    api: &Api,
    request: Request<api::ListPoolsRequest>,
) -> Result<Response<api::ListPoolsResponse>, Status> {
    api.admin(&request, Scope::Read, "AdminService.ListPools", "")
        .await?;
    let pools = api.pools.list().await?.into_iter().map(pool).collect();
    Ok(Response::new(api::ListPoolsResponse { pools }))
}

/// AdminService.SetPool (admin:write).
pub(super) async fn set_pool(
    api: &Api,
    request: Request<api::SetPoolRequest>,
) -> Result<Response<api::Pool>, Status> {
    let mut target = format!(
        "{}/{}",
        request.get_ref().lesson_slug,
        request.get_ref().stage
    );
    if target.len() > MAX_TARGET {
        let mut end = MAX_TARGET;
        while !target.is_char_boundary(end) {
            end -= 1;
        }
        target.truncate(end);
    }
    let identity = api
        .admin(&request, Scope::Write, "AdminService.SetPool", &target)
        .await?;
    let api::SetPoolRequest {
        lesson_slug,
        stage,
        size,
        windows,
    } = request.into_inner();
    let windows = windows
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let time = |text: &str| {
                clock_time::parse(text).map_err(|reason| Error::InvalidArgument {
                    field: "windows",
                    reason: format!("windows[{i}]: {reason}"),
                })
            };
            Ok(PoolWindow {
                from: time(&w.from)?,
                to: time(&w.to)?,
                size: w.size,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let stored = api
        .pools
        .set(&lesson_slug, stage, size, &windows, &identity)
        .await?;
    let target = api.pools.target(&stored);
    let view = api
        .pools
        .list()
        .await?
        .into_iter()
        .find(|v| v.pool.lesson_slug == lesson_slug && v.pool.stage == stage)
        .unwrap_or(PoolView {
            pool: stored,
            target,
            members: Vec::new(),
            hits: 0,
            misses: 0,
        });
    Ok(Response::new(pool(view)))
}

/// A pool as the admin API shows it.
fn pool(view: PoolView) -> api::Pool {
    let count = |statuses: &[&str]| {
        view.members
            .iter()
            .filter(|c| statuses.contains(&c.status.as_str()))
            .map(|c| c.count as u32)
            .sum()
    };
    api::Pool {
        ready: count(&["READY"]),
        starting: count(&["PENDING", "BOOTING", "CONFIGURING"]),
        removing: count(&["TERMINATING"]),
        failed: count(&["FAILED"]),
        target: view.target,
        hits: view.hits,
        misses: view.misses,
        lesson_slug: view.pool.lesson_slug,
        stage: view.pool.stage,
        size: view.pool.size,
        windows: view
            .pool
            .windows
            .iter()
            .map(|w| api::PoolWindow {
                from: clock_time::show(w.from),
                to: clock_time::show(w.to),
                size: w.size,
            })
            .collect(),
        source: view.pool.source,
        updated_by: view.pool.updated_by,
        updated_at: Some(wire::timestamp(view.pool.updated_at)),
    }
}
