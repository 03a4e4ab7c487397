//! The admin HTTP API (routes listed in the `vesta-api` crate). Handlers are thin: parse,
//! call the daemon, map its error kind to a status code.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;

use vesta_api as api;

use crate::daemon::{Daemon, OpError};

impl IntoResponse for OpError {
    fn into_response(self) -> Response {
        let status = match &self {
            OpError::BadRequest(_) => StatusCode::BAD_REQUEST,
            OpError::NotFound(_) => StatusCode::NOT_FOUND,
            OpError::Conflict(_) => StatusCode::CONFLICT,
            OpError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            OpError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (
            status,
            Json(api::ApiError {
                error: self.to_string(),
            }),
        )
            .into_response()
    }
}

type D = State<Arc<Daemon>>;

/// Runs an admin operation to completion even if the HTTP client goes away: hyper drops a
/// handler's future when its connection closes, and an operation cut off halfway (storage
/// created, record not yet written) would leave the two disagreeing.
async fn detached<T: Send + 'static>(
    op: impl std::future::Future<Output = Result<T, OpError>> + Send + 'static,
) -> Result<T, OpError> {
    tokio::spawn(op)
        .await
        .unwrap_or_else(|e| Err(OpError::Internal(format!("admin operation failed: {e}"))))
}

pub fn router(d: Arc<Daemon>) -> Router {
    Router::new()
        .route("/v1/status", get(status))
        .route("/v1/hosts", get(list_hosts))
        .route("/v1/hosts/replay-cache", axum::routing::post(replay_cache))
        .route("/v1/datastores", get(list_datastores).post(add_datastore))
        .route("/v1/volumes", get(list_volumes).post(create_volume))
        .route("/v1/volumes/{name}", get(show_volume).delete(delete_volume))
        .route("/v1/volumes/{name}/policy", axum::routing::post(set_policy))
        .route("/v1/volumes/{name}/relocate", axum::routing::post(relocate))
        .route(
            "/v1/volumes/{name}/accept-loss",
            axum::routing::post(accept_loss),
        )
        .route("/v1/stats", get(stats))
        .route("/v1/models", get(models))
        .route("/v1/balance/plan", get(balance_plan))
        .route("/v1/calibration", get(get_calibration).put(put_calibration))
        .route("/v1/debug/faults", axum::routing::post(faults))
        .fallback(|| async {
            OpError::NotFound("no such API path; see the vesta-api crate for the routes".into())
        })
        .with_state(d)
}

async fn status(State(d): D) -> Json<api::Status> {
    Json(d.status())
}

async fn list_datastores(State(d): D) -> Json<Vec<api::DatastoreInfo>> {
    Json(d.datastore_infos().await)
}

/// Bodies that fail to parse get our error shape, not axum's plain text.
fn body<T>(b: Result<Json<T>, axum::extract::rejection::JsonRejection>) -> Result<T, OpError> {
    b.map(|Json(v)| v)
        .map_err(|e| OpError::BadRequest(format!("bad request body: {}", e.body_text())))
}

async fn add_datastore(
    State(d): D,
    b: Result<Json<api::AddDatastore>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<api::DatastoreInfo>), OpError> {
    let req = body(b)?;
    let info = detached(async move { d.add_datastore(req).await }).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

async fn list_volumes(State(d): D) -> Json<Vec<api::VolumeInfo>> {
    let mut out: Vec<api::VolumeInfo> = d.entries().iter().map(|e| d.volume_info(e)).collect();
    out.extend(d.foreign_volumes().await);
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Json(out)
}

async fn list_hosts(State(d): D) -> Result<Json<Vec<api::HostInfo>>, OpError> {
    Ok(Json(d.host_infos().await?))
}

async fn replay_cache(
    State(d): D,
    b: Result<Json<api::SurrogateReplay>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<api::SurrogateReport>, OpError> {
    let req = body(b)?;
    let (volumes, not_replayed) = detached(async move {
        crate::peers::surrogate_replay(&d, std::path::Path::new(&req.path), req.force)
            .await
            .map_err(OpError::BadRequest)
    })
    .await?;
    Ok(Json(api::SurrogateReport {
        volumes,
        not_replayed,
    }))
}

async fn create_volume(
    State(d): D,
    b: Result<Json<api::CreateVolume>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<api::VolumeInfo>), OpError> {
    let req = body(b)?;
    let info = detached(async move { d.create_volume(req).await }).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

async fn show_volume(
    State(d): D,
    Path(name): Path<String>,
) -> Result<Json<api::VolumeInfo>, OpError> {
    match d.entry(&name) {
        Ok(e) => Ok(Json(d.volume_info(&e))),
        Err(OpError::NotFound(m)) => d.foreign(&name).await.map(Json).ok_or(OpError::NotFound(m)),
        Err(e) => Err(e),
    }
}

#[derive(Deserialize)]
struct DeleteQuery {
    #[serde(default)]
    force: bool,
}

async fn delete_volume(
    State(d): D,
    Path(name): Path<String>,
    Query(q): Query<DeleteQuery>,
) -> Result<Json<api::VolumeInfo>, OpError> {
    Ok(Json(
        detached(async move { d.delete_volume(&name, q.force).await }).await?,
    ))
}

async fn set_policy(
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<api::SetPolicy>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<api::VolumeInfo>, OpError> {
    let req = body(b)?;
    Ok(Json(
        detached(async move { d.set_policy(&name, req).await }).await?,
    ))
}

#[derive(Deserialize)]
struct FaultReq {
    cache_device: String,
}

/// `POST /v1/debug/faults {"cache_device": "fail" | "record" | "power_cut"}`: only with
/// `vestad --test-faults`.
async fn faults(Json(f): Json<FaultReq>) -> Result<Json<serde_json::Value>, OpError> {
    let Some(dev) = crate::faults::CACHE.get() else {
        return Err(OpError::NotFound(
            "fault injection is off (vestad --test-faults enables it)".into(),
        ));
    };
    match f.cache_device.as_str() {
        "fail" => {
            tracing::warn!("test fault: the cache device now fails every IO");
            dev.fail();
            Ok(Json(serde_json::json!({"cache_device": "failed"})))
        }
        "record" => {
            let dev = dev.clone();
            datastore::device::on_pool(move || dev.record_power_cut())
                .await
                .map_err(|e| OpError::Internal(format!("recording for a power cut: {e}")))?;
            tracing::warn!(
                "test fault: the cache device keeps what each write replaces, for a power cut"
            );
            Ok(Json(serde_json::json!({"cache_device": "recording"})))
        }
        "power_cut" => {
            // A host without power stops at once: no reply, no shutdown, no flush. The log
            // line (stderr, unbuffered) is the only report.
            let dev = dev.clone();
            let cut =
                datastore::device::on_pool(move || -> std::io::Result<std::convert::Infallible> {
                    let undone = dev.power_cut()?;
                    tracing::warn!(
                        "test fault: power cut; {undone} cache device write(s) no sync covered \
                     are undone, and vestad stops at once"
                    );
                    // SAFETY: _exit ends the process without running anything else.
                    unsafe { libc::_exit(0) }
                })
                .await;
            let Err(e) = cut;
            Err(OpError::Internal(format!("power cut: {e}")))
        }
        other => Err(OpError::BadRequest(format!(
            "unknown fault {other:?}; known: fail, record, power_cut"
        ))),
    }
}

#[derive(Deserialize)]
struct StatsQuery {
    volume: Option<String>,
}

async fn stats(
    State(d): D,
    Query(q): Query<StatsQuery>,
) -> Result<Json<api::StatsReport>, OpError> {
    if let Some(v) = &q.volume {
        d.entry(v)?;
    }
    Ok(Json(crate::stats::report(&d, q.volume.as_deref())))
}

async fn relocate(
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<api::Relocate>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<api::VolumeInfo>, OpError> {
    let req = body(b)?;
    Ok(Json(
        detached(async move { d.relocate(&name, req).await }).await?,
    ))
}

async fn models(State(d): D) -> Json<api::ModelsReport> {
    Json(crate::balancing::inputs(&d).await.report)
}

#[derive(Deserialize)]
struct PlanQuery {
    max_moves: Option<usize>,
    threshold: Option<f64>,
}

async fn balance_plan(
    State(d): D,
    Query(q): Query<PlanQuery>,
) -> Result<Json<api::BalancePlan>, OpError> {
    let mut policy = balance::Policy::default();
    if let Some(m) = q.max_moves {
        policy.max_moves = m;
    }
    if let Some(t) = q.threshold {
        if !(t.is_finite() && t >= 0.0) {
            return Err(OpError::BadRequest(format!(
                "threshold {t} is not a non-negative number (the imbalance f to stop at, e.g. \
                 0.1)"
            )));
        }
        policy.imbalance_threshold = t;
    }
    Ok(Json(crate::balancing::plan(&d, &policy).await?))
}

async fn get_calibration(State(d): D) -> Result<Json<api::Calibration>, OpError> {
    crate::balancing::calibration(&d).map(Json).ok_or_else(|| {
        OpError::NotFound(
            "no calibration is stored; the default constants are in use (run `vesta \
             calibrate DATASTORE`)"
                .into(),
        )
    })
}

async fn put_calibration(
    State(d): D,
    b: Result<Json<api::Calibration>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<api::Calibration>, OpError> {
    let c = body(b)?;
    crate::balancing::store_calibration(&d, &c)?;
    tracing::info!(
        "stored workload constants calibrated on {}: {:?}",
        c.datastore,
        c.constants
    );
    Ok(Json(c))
}

async fn accept_loss(
    State(d): D,
    Path(name): Path<String>,
    b: Result<Json<api::AcceptLoss>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<api::LossReport>, OpError> {
    let req = body(b)?;
    let r = detached(async move { d.accept_loss(&name, req.dry_run).await }).await?;
    Ok(Json(r))
}
