//! The daemon's routes. Request bodies are size-limited JSON; anything
//! malformed is a 4xx with `{"error": {"kind", "message", …}}`, never a 500.

use super::MAX_BODY_BYTES;
use crate::wire::StartLine;
use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::handler::Handler;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use axum::{Json, Router};
use broker_capabilities::bindings::BrokerError;
use broker_capabilities::error_text::error_text;
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::{Broker, BrokerServiceError};
use broker_core::error_report::{ErrorKind, ErrorReport};
use broker_core::groups::{GroupError, Groups};
use broker_core::providers::registry::RegistryError;
use broker_core::providers::view::{BreakerView, ProviderView};
use broker_core::version::CallError;
use broker_core::version::ProviderStats;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::Ordering;

type Shared = Arc<Broker>;

/// What the routes share: the broker, and the work they started that must
/// run to its end whether or not its client stays (the drain waits for it).
#[derive(Clone)]
pub(crate) struct ApiState {
    pub(crate) broker: Shared,
    pub(crate) groups: Arc<Groups>,
    pub(crate) detached: tokio_util::task::TaskTracker,
}

impl axum::extract::FromRef<ApiState> for Shared {
    fn from_ref(state: &ApiState) -> Shared {
        state.broker.clone()
    }
}

impl axum::extract::FromRef<ApiState> for Arc<Groups> {
    fn from_ref(state: &ApiState) -> Arc<Groups> {
        state.groups.clone()
    }
}

impl axum::extract::FromRef<ApiState> for tokio_util::task::TaskTracker {
    fn from_ref(state: &ApiState) -> Self {
        state.detached.clone()
    }
}

type Detached = tokio_util::task::TaskTracker;

/// An error as the API reports it: its status and `{"error": report}`.
pub(crate) struct ApiError(StatusCode, ErrorReport);

impl ApiError {
    /// The client's mistake, found by the API itself.
    fn bad_request(message: impl Into<String>) -> Self {
        ApiError(StatusCode::BAD_REQUEST, ErrorReport::new(ErrorKind::BadRequest, message))
    }

    /// The same error, about `instance` unless it names one already.
    fn about_instance(self, instance: &str) -> Self {
        ApiError(self.0, self.1.about_instance(instance))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.0, Json(crate::wire::error_body(&self.1))).into_response();
        if self.0 == StatusCode::SERVICE_UNAVAILABLE {
            // Busy, half-open, being removed or shutting down: all pass in seconds.
            response.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        // Too large stays 413; every other malformed body is the client's 400.
        let status = match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError(status, ErrorReport::new(ErrorKind::BadRequest, rejection.body_text()))
    }
}

fn registry_status(err: &RegistryError) -> StatusCode {
    match err {
        RegistryError::UnknownProvider(_) => StatusCode::NOT_FOUND,
        RegistryError::AlreadyRegistered { .. }
        | RegistryError::HasInstances { .. }
        | RegistryError::SwapRefused { .. } => StatusCode::CONFLICT,
        RegistryError::Path { .. } | RegistryError::Candidate { .. } | RegistryError::Load(_) => {
            StatusCode::UNPROCESSABLE_ENTITY
        }
        RegistryError::ConfigRejected { .. } | RegistryError::InDataDir(_) => StatusCode::UNPROCESSABLE_ENTITY,
        RegistryError::GrantsWidened { .. } => StatusCode::CONFLICT,
        RegistryError::Call(_) => StatusCode::BAD_GATEWAY,
        RegistryError::Removing(_) | RegistryError::DrainTimeout { .. } => StatusCode::SERVICE_UNAVAILABLE,
        RegistryError::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl From<RegistryError> for ApiError {
    fn from(err: RegistryError) -> Self {
        ApiError(registry_status(&err), err.report())
    }
}

impl From<BrokerServiceError> for ApiError {
    fn from(err: BrokerServiceError) -> Self {
        let status = match &err {
            BrokerServiceError::Registry(e) => registry_status(e),
            BrokerServiceError::UnknownInstance(_) => StatusCode::NOT_FOUND,
            BrokerServiceError::AmbiguousInstance { .. } | BrokerServiceError::AtRecordBound { .. } => {
                StatusCode::CONFLICT
            }
            BrokerServiceError::Recorded(_) | BrokerServiceError::ByName(_) => StatusCode::BAD_REQUEST,
            // The provider answered with an id the host does not take.
            BrokerServiceError::InvalidInstanceId { .. }
            | BrokerServiceError::EndlessListing { .. }
            | BrokerServiceError::InstanceIdTaken { .. }
            | BrokerServiceError::InstanceIdReused { .. } => StatusCode::BAD_GATEWAY,
            BrokerServiceError::Call(CallError::Unavailable { .. } | CallError::Busy { .. }) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            // This host's storage failed, not the provider.
            BrokerServiceError::Call(CallError::Storage { .. }) => StatusCode::INTERNAL_SERVER_ERROR,
            BrokerServiceError::Call(call) => match call.broker_error() {
                Some(BrokerError::InvalidParams(_)) => StatusCode::BAD_REQUEST,
                Some(BrokerError::NotFound(_)) => StatusCode::NOT_FOUND,
                // The provider or its infrastructure failed, not this host.
                _ => StatusCode::BAD_GATEWAY,
            },
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, err.report())
    }
}

impl From<broker_core::store::StoreError> for ApiError {
    fn from(err: broker_core::store::StoreError) -> Self {
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, ErrorReport::new(ErrorKind::Storage, error_text(&err)))
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// Run a change of the host's state to its end even if the client goes away.
/// A handler's future is dropped when its client disconnects; the store's
/// commit and what follows it (the registry's slot, a record) must not be cut
/// apart by that.
async fn to_the_end<T, E>(
    detached: &Detached,
    work: impl Future<Output = Result<T, E>> + Send + 'static,
) -> ApiResult<T>
where
    T: Send + 'static,
    E: Into<ApiError> + Send + 'static,
{
    match detached.spawn(work).await {
        Ok(done) => done.map_err(Into::into),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorReport::new(ErrorKind::Unavailable, "the daemon is shutting down"),
        )),
    }
}

/// One route of the API, declared once in [`routes`]: the router is built
/// from that list and `openapi.json` is checked against it (the seam from
/// which the operators' page will derive the document).
pub(crate) struct Route {
    /// `GET`, `POST`, `PUT` or `DELETE`.
    #[cfg_attr(
        not(test),
        allow(dead_code, reason = "read by the OpenAPI check; the operators' page will derive the document from it")
    )]
    pub(crate) method: &'static str,
    /// Its path, `{name}` for a parameter (as axum and OpenAPI both spell it).
    pub(crate) path: &'static str,
    handler: MethodRouter<ApiState>,
}

/// A route's constructor per method: the method it is listed under is the one it serves.
macro_rules! method {
    ($($name:ident => $method:literal),*) => {
        impl Route {
            $(
                fn $name<H: Handler<T, ApiState>, T: 'static>(path: &'static str, handler: H) -> Route {
                    Route { method: $method, path, handler: axum::routing::$name(handler) }
                }
            )*
        }
    };
}

method!(get => "GET", post => "POST", put => "PUT", delete => "DELETE");

/// Every route of the API.
pub(crate) fn routes() -> Vec<Route> {
    vec![
        Route::get("/healthz", healthz),
        Route::get("/metrics", metrics),
        Route::get("/openapi.json", openapi),
        Route::get("/v1/providers", list_providers),
        Route::post("/v1/providers", add_provider),
        Route::get("/v1/providers/{name}", show_provider),
        Route::delete("/v1/providers/{name}", remove_provider),
        Route::post("/v1/providers/{name}/swap", swap_provider),
        Route::post("/v1/providers/{name}/call", call_provider),
        Route::get("/v1/instances", list_instances),
        Route::post("/v1/instances", start_instance),
        Route::delete("/v1/instances/{id}", stop_instance),
        Route::post("/v1/instances/{id}/maintain", maintain_instance),
        Route::get("/v1/events", events),
        Route::get("/v1/lock", lock_report),
        Route::get("/v1/groups", list_groups),
        Route::post("/v1/groups", commit_group),
        Route::get("/v1/groups/{id}", describe_group),
        Route::delete("/v1/groups/{id}", destroy_group),
        Route::get("/v1/groups/{id}/spec", group_spec),
        Route::get("/v1/groups/{id}/size", group_size),
        Route::put("/v1/groups/{id}/size", set_group_size),
        Route::post("/v1/groups/{id}/destroy-instances", destroy_group_instances),
        Route::post("/v1/groups/{id}/free", free_group),
    ]
}

/// The routes, each request bounded (see [`crate::listen::bounded_request_up_to`]).
pub(crate) fn router_with(
    broker: Shared,
    groups: Arc<Groups>,
    detached: Detached,
    body_timeout: std::time::Duration,
) -> Router {
    // Two methods on one path are merged into one method router by axum.
    let router = routes().into_iter().fold(Router::new(), |router, route| router.route(route.path, route.handler));
    router
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::map_request(json_by_default))
        .layer(axum::middleware::from_fn(move |request, next| {
            crate::listen::bounded_request_up_to(body_timeout, MAX_BODY_BYTES, request, next)
        }))
        .with_state(ApiState { broker, groups, detached })
}

/// Every body the API takes is JSON: one sent without saying so (`curl -d`
/// says `application/x-www-form-urlencoded`; some clients say nothing) is
/// read as JSON, and one that is not JSON gets the parser's 400.
async fn json_by_default(mut request: axum::extract::Request) -> axum::extract::Request {
    use axum::http::header::{CONTENT_TYPE, HeaderValue};
    let says_json = request.headers().get(CONTENT_TYPE).and_then(|kind| kind.to_str().ok()).is_some_and(|kind| {
        let essence = kind.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        essence == "application/json" || essence.ends_with("+json")
    });
    if !says_json {
        request.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    request
}

impl From<GroupError> for ApiError {
    fn from(err: GroupError) -> Self {
        let err = match err {
            GroupError::Broker(inner) => return inner.into(),
            other => other,
        };
        let status = match &err {
            GroupError::Spec(_) | GroupError::UnknownProvider(_) => StatusCode::BAD_REQUEST,
            GroupError::UnknownGroup(_) => StatusCode::NOT_FOUND,
            GroupError::ProviderChanged { .. }
            | GroupError::AllocationChanged { .. }
            | GroupError::NotAMember { .. }
            | GroupError::QuorumSize(_)
            | GroupError::TooManyGroups(_)
            | GroupError::ProviderGone { .. } => StatusCode::CONFLICT,
            GroupError::Store(_) | GroupError::StoredSpec { .. } | GroupError::PassPanicked(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            // The group is gone; its members' stop failed, mostly at the provider.
            GroupError::StopsUnfinished { .. } => StatusCode::BAD_GATEWAY,
            // Answered above, as the broker's own errors are.
            GroupError::Broker(_) => StatusCode::BAD_GATEWAY,
        };
        ApiError(status, err.report())
    }
}

#[derive(Deserialize)]
struct CommitQuery {
    #[serde(default)]
    pretend: bool,
}

/// Commit a group spec (InfraKit's shape, as JSON); `?pretend=true` only plans.
async fn commit_group(
    State(groups): State<Arc<Groups>>,
    State(detached): State<Detached>,
    Query(query): Query<CommitQuery>,
    body: Result<Json<broker_core::groups::spec::GroupSpec>, JsonRejection>,
) -> ApiResult<Response> {
    let Json(spec) = body?;
    let group = broker_core::groups::spec::Group::check(spec).map_err(GroupError::from)?;
    // Runs to its end if the client goes away: a commit half made is none.
    let plan = to_the_end(&detached, async move { groups.commit(group, query.pretend).await }).await?;
    Ok(Json(json!({ "plan": plan, "pretend": query.pretend })).into_response())
}

/// Every group: its spec's id, provider and size, its members and whether it converged.
async fn list_groups(State(groups): State<Arc<Groups>>) -> ApiResult<Response> {
    let mut described = Vec::new();
    for spec in groups.inspect()? {
        described.push(groups.describe(&spec.id).await?);
    }
    Ok(Json(described).into_response())
}

async fn describe_group(State(groups): State<Arc<Groups>>, Path(id): Path<String>) -> ApiResult<Response> {
    Ok(Json(groups.describe(&id).await?).into_response())
}

async fn group_spec(State(groups): State<Arc<Groups>>, Path(id): Path<String>) -> ApiResult<Response> {
    let spec = groups.inspect()?.into_iter().find(|spec| spec.id == id);
    let spec = spec.ok_or_else(|| ApiError::from(GroupError::UnknownGroup(id)))?;
    Ok(Json(spec).into_response())
}

async fn group_size(State(groups): State<Arc<Groups>>, Path(id): Path<String>) -> ApiResult<Response> {
    Ok(Json(json!({ "size": groups.size(&id)? })).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SizeRequest {
    size: u32,
}

async fn set_group_size(
    State(groups): State<Arc<Groups>>,
    State(detached): State<Detached>,
    Path(id): Path<String>,
    body: Result<Json<SizeRequest>, JsonRejection>,
) -> ApiResult<Response> {
    let Json(request) = body?;
    let plan = to_the_end(&detached, async move { groups.set_size(&id, request.size).await }).await?;
    Ok(Json(json!({ "plan": plan })).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DestroyInstancesRequest {
    instances: Vec<String>,
}

async fn destroy_group_instances(
    State(groups): State<Arc<Groups>>,
    State(detached): State<Detached>,
    Path(id): Path<String>,
    body: Result<Json<DestroyInstancesRequest>, JsonRejection>,
) -> ApiResult<Response> {
    let Json(request) = body?;
    let ids = request.instances;
    to_the_end(&detached, async move { groups.destroy_instances(&id, &ids).await }).await?;
    Ok(Json(json!({ "destroyed": true })).into_response())
}

async fn free_group(
    State(groups): State<Arc<Groups>>,
    State(detached): State<Detached>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    to_the_end(&detached, async move { groups.free(&id).await }).await?;
    Ok(Json(json!({ "freed": true })).into_response())
}

async fn destroy_group(
    State(groups): State<Arc<Groups>>,
    State(detached): State<Detached>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    to_the_end(&detached, async move { groups.destroy(&id).await }).await?;
    Ok(Json(json!({ "destroyed": true })).into_response())
}

async fn list_providers(State(broker): State<Shared>) -> ApiResult<Response> {
    Ok(Json(broker.registry().list_shown()?).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddProvider {
    /// Path of the provider.toml, on the daemon's machine.
    manifest: std::path::PathBuf,
}

async fn add_provider(
    State(broker): State<Shared>,
    State(detached): State<Detached>,
    body: Result<Json<AddProvider>, JsonRejection>,
) -> ApiResult<Response> {
    let Json(request) = body?;
    let record = to_the_end(&detached, async move { broker.registry().add(&request.manifest).await }).await?;
    Ok((StatusCode::CREATED, Json(record)).into_response())
}

/// The provider as `broker provider show --json` prints it, with the crash policy's state.
async fn show_provider(State(broker): State<Shared>, Path(name): Path<String>) -> ApiResult<Response> {
    let (record, manifest) = broker.registry().show(&name)?;
    let (half_open, trips) = broker.registry().get(&name).await?.breaker_state();
    let mut view = ProviderView::new(&record, &manifest);
    view.breaker = Some(BreakerView { half_open, trips });
    Ok(Json(view).into_response())
}

async fn remove_provider(
    State(broker): State<Shared>,
    State(detached): State<Detached>,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    let removing = name.clone();
    to_the_end(&detached, async move { broker.registry().remove(&removing).await }).await?;
    Ok(Json(json!({ "removed": name })).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Swap {
    component: std::path::PathBuf,
    #[serde(default)]
    check: bool,
}

async fn swap_provider(
    State(broker): State<Shared>,
    State(detached): State<Detached>,
    Path(name): Path<String>,
    body: Result<Json<Swap>, JsonRejection>,
) -> ApiResult<Response> {
    let Json(request) = body?;
    let swapped = to_the_end(&detached, async move {
        let kit = broker_core::conformance::ConformanceCheck;
        broker.registry().swap(&name, &request.component, request.check.then_some(&kit as _)).await
    })
    .await?;
    Ok(Json(swapped).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CallRequest {
    /// As manifests spell it: `describe`, `validate-config`, `all-instances`.
    method: String,
    #[serde(default)]
    params: Option<serde_json::Value>,
}

/// One method of a registered provider that changes nothing the host
/// records; its typed answer (`broker provider call`).
async fn call_provider(
    State(broker): State<Shared>,
    Path(name): Path<String>,
    body: Result<Json<CallRequest>, JsonRejection>,
) -> ApiResult<Response> {
    let Json(request) = body?;
    let method = broker_core::version::by_name::method_named(&request.method)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let answer = broker.call_provider(&name, method, request.params.as_ref()).await?;
    Ok(Json(json!({ "answer": answer })).into_response())
}

#[derive(Deserialize)]
struct ProviderFilter {
    provider: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    provider: Option<String>,
    /// At most this many records (a page, of at most `listing::MAX_PAGE`);
    /// `X-Next-After` then names the cursor of the next.
    limit: Option<usize>,
    /// Only records after this cursor (what `X-Next-After` gave; or
    /// `PROVIDER/ID`), in the listing's order.
    after: Option<String>,
}

/// How many records the full listing reads at once: a provider that pages
/// in id order is asked a page of its own at a time whatever this is; one
/// that does not is listed whole once per this many (a `max-records` of the
/// default, once).
const STREAMED_PAGE: usize = broker_core::broker::listing::MAX_PAGE;

/// The instances, a page of them (`limit`), or all of them streamed a page
/// at a time: the host never holds the whole listing. An instance started or
/// stopped while the listing streams may be in it or not.
async fn list_instances(State(broker): State<Shared>, Query(query): Query<ListQuery>) -> ApiResult<Response> {
    use broker_core::broker::ListCursor;
    if query.limit == Some(0) {
        return Err(ApiError::bad_request("limit: at least 1"));
    }
    let from = match query.after.as_deref() {
        Some(after) => {
            Some(ListCursor::parse(after, broker.cursor_key()).map_err(|e| ApiError::bad_request(e.to_string()))?)
        }
        None => None,
    };
    let only = query.provider;
    if let (Some(only), Some(from)) = (&only, &from)
        && *only != from.provider
    {
        return Err(ApiError::bad_request(format!("after: a cursor of provider {}, not of {only}", from.provider)));
    }
    if let Some(limit) = query.limit {
        let page = broker.instances_page(only.as_deref(), from, limit).await?;
        let mut response = Json(page.records).into_response();
        let next = page.next.map(|next| next.to_text(broker.cursor_key()));
        if let Some(next) = next.and_then(|next| header::HeaderValue::from_str(&next).ok()) {
            response.headers_mut().insert("x-next-after", next);
        }
        return Ok(response);
    }
    // The first page's failure is the answer's status; a later one ends the
    // stream short of its closing bracket, so no client takes it for the whole.
    let first = broker.instances_page(only.as_deref(), from, STREAMED_PAGE).await?;
    // The state: the page to write, and whether a record was written before it.
    let pages = futures_util::stream::unfold(Some((first, false)), move |state| {
        let (broker, only) = (broker.clone(), only.clone());
        async move {
            let (page, mut written) = state?;
            let mut chunk = Vec::with_capacity(page.records.len() * 256 + 2);
            if !written {
                chunk.push(b'[');
            }
            for record in &page.records {
                if written {
                    chunk.push(b',');
                }
                if let Err(e) = serde_json::to_writer(&mut chunk, record) {
                    return Some((Err(std::io::Error::other(e)), None));
                }
                written = true;
            }
            let Some(next) = page.next else {
                chunk.push(b']');
                return Some((Ok(axum::body::Bytes::from(chunk)), None));
            };
            if !written {
                // Not opened twice: the bracket comes with the first record, or the end.
                chunk.clear();
            }
            match broker.instances_page(only.as_deref(), Some(next), STREAMED_PAGE).await {
                Ok(page) => Some((Ok(chunk.into()), Some((page, written)))),
                Err(failed) => {
                    tracing::warn!(error = %error_text(&failed), "the streamed listing of instances ended short");
                    Some((Err(std::io::Error::other(error_text(&failed))), None))
                }
            }
        }
    });
    Ok(([(header::CONTENT_TYPE, "application/json")], Body::from_stream(pages)).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartRequest {
    provider: String,
    /// Juju's syntax: `mem=2G cores=2 zones=a,b`.
    #[serde(default)]
    constraints: String,
    #[serde(default)]
    placement: Option<String>,
    /// cloud-init user data, as text.
    #[serde(default)]
    user_data: Option<String>,
    /// Instance tags, set on the instance config.
    #[serde(default)]
    tags: std::collections::BTreeMap<String, String>,
    /// The whole `StartInstanceParams`; the fields above apply over it.
    #[serde(default)]
    params: Option<serde_json::Value>,
}

/// Start an instance. The answer streams as NDJSON, one line per status update
/// as the provider reports it, then `{"event":"started","instance":…}` or
/// `{"event":"failed","error":…}`. The start runs to its end even if the client goes away.
async fn start_instance(
    State(broker): State<Shared>,
    State(detached): State<Detached>,
    body: Result<Json<StartRequest>, JsonRejection>,
) -> ApiResult<Response> {
    let Json(request) = body?;
    let tags: Vec<(String, String)> = request.tags.into_iter().collect();
    let params = broker_capabilities::contract::start::start_params(broker_capabilities::contract::start::StartInput {
        params: request.params.as_ref(),
        constraints: &request.constraints,
        placement: request.placement.as_deref(),
        user_data: request.user_data.map(String::into_bytes),
        tags: &tags,
    })
    .map_err(|e| ApiError::bad_request(e.to_string()))?;
    broker.registry().get(&request.provider).await?;

    // Bounded whatever the provider reports and however slowly the client reads.
    let lines = Arc::new(super::progress::ProgressQueue::<StartLine>::new(super::progress::QUEUED_LINES));
    let status_lines = lines.clone();
    let hooks = CallHooks::with_events(move |event| status_lines.push(StartLine::from(event)));
    let finished = lines.clone();
    detached.spawn(async move {
        // If the start panics, its client is told so rather than left waiting.
        let mut unfinished = FinishOnDrop(Some(finished.clone()));
        let last = match broker.start_instance(&request.provider, &params, &hooks).await {
            Ok(record) => StartLine::Started { instance: Box::new(record) },
            Err(err) => StartLine::Failed { error: err.report().about_provider(&request.provider) },
        };
        if finished.coalesced() > 0 {
            tracing::debug!(coalesced = finished.coalesced(), "a start's client was behind: statuses coalesced");
        }
        unfinished.0 = None;
        finished.finish(last);
    });
    let stream = futures_util::stream::unfold(lines, |lines| async move {
        let line = serde_json::to_string(&lines.next().await?).unwrap_or_default();
        Some((Ok::<_, std::convert::Infallible>(format!("{line}\n")), lines))
    });
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(stream)).into_response())
}

/// Ends a start's stream with a failure if its task goes without finishing it
/// (a panic): the client gets an answer, and the drain does not wait on it.
struct FinishOnDrop(Option<Arc<super::progress::ProgressQueue<StartLine>>>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        if let Some(lines) = self.0.take() {
            let report = ErrorReport::new(ErrorKind::Other, "the start failed inside the host (a bug: see its log)");
            lines.finish(StartLine::Failed { error: report });
        }
    }
}

/// The provider named in the query, or the one the host recorded the instance for.
fn owner(broker: &Broker, id: &str, filter: ProviderFilter) -> Result<String, BrokerServiceError> {
    match filter.provider {
        Some(provider) => Ok(provider),
        None => broker.provider_of(id),
    }
}

async fn stop_instance(
    State(broker): State<Shared>,
    State(detached): State<Detached>,
    Path(id): Path<String>,
    Query(filter): Query<ProviderFilter>,
) -> ApiResult<Response> {
    // Idempotent, as Juju's StopInstances: an id the host has no record of
    // (never started here, or stopped already) is nothing to stop.
    let owner = match filter.provider {
        Some(provider) => Some(provider),
        None => broker.owner_for_stop(&id).await.map_err(|e| ApiError::from(e).about_instance(&id))?,
    };
    let Some(provider) = owner else {
        return Ok(Json(json!({ "id": id, "provider": null, "stopped": false })).into_response());
    };
    let (stopping, ids) = (provider.clone(), vec![id.clone()]);
    to_the_end(&detached, async move { broker.stop_instances(&stopping, &ids).await })
        .await
        .map_err(|e| e.about_instance(&id))?;
    Ok(Json(json!({ "id": id, "provider": provider, "stopped": true })).into_response())
}

async fn maintain_instance(
    State(broker): State<Shared>,
    Path(id): Path<String>,
    Query(filter): Query<ProviderFilter>,
) -> ApiResult<Response> {
    let about = |e: BrokerServiceError| ApiError::from(e).about_instance(&id);
    let provider = owner(&broker, &id, filter).map_err(about)?;
    broker.maintain_instance(&provider, &id).await.map_err(about)?;
    Ok(Json(json!({ "maintained": id, "provider": provider })).into_response())
}

#[derive(Deserialize)]
struct EventsQuery {
    #[serde(default)]
    after: u64,
    #[serde(default = "default_limit")]
    limit: usize,
}

fn default_limit() -> usize {
    100
}

async fn events(State(broker): State<Shared>, Query(query): Query<EventsQuery>) -> ApiResult<Response> {
    Ok(Json(broker.store().events(query.after, query.limit.min(10_000))?).into_response())
}

/// One version's counters as `/metrics` labels them: the versions serving, and
/// those retired lately (their calls in flight still count; a scrape after a
/// swap sees the last of them). Only a serving version has a breaker.
struct Source {
    labels: String,
    stats: Arc<ProviderStats>,
    breaker: Option<(bool, u64)>,
}

fn sources(broker: &Broker) -> Vec<Source> {
    use broker_core::store::records::short_sha256;
    let label = |name: &str, sha256: &str| format!("provider=\"{name}\",sha256=\"{}\"", short_sha256(sha256));
    let mut sources: Vec<Source> = broker
        .registry()
        .loaded()
        .iter()
        .map(|p| Source {
            labels: label(p.name(), p.sha256()),
            stats: p.shared_stats(),
            breaker: Some(p.breaker_state()),
        })
        .collect();
    // Newest first: a version swapped out twice, or out and back in, is one series.
    for retired in broker.registry().retired().into_iter().rev() {
        let labels = label(&retired.name, &retired.sha256);
        if !sources.iter().any(|s| s.labels == labels) {
            sources.push(Source { labels, stats: retired.stats, breaker: None });
        }
    }
    sources
}

/// Per version and method: outcomes (ok, error, trap, deadline, limit,
/// instantiate, unavailable) and a latency histogram. Methods never called are left out.
fn per_method(text: &mut String, sources: &[Source]) {
    use broker_core::version::method_stats::{MethodStats, Outcome};
    fn called(source: &Source) -> Vec<(String, &MethodStats)> {
        source
            .stats
            .methods
            .iter()
            .filter(|(_, stats)| stats.count() > 0)
            .map(|(method, stats)| (format!("{},method=\"{}\"", source.labels, method.name()), stats))
            .collect()
    }
    text.push_str("# HELP broker_calls_total Calls finished, by outcome.\n");
    text.push_str("# TYPE broker_calls_total counter\n");
    for source in sources {
        for (labels, stats) in called(source) {
            for outcome in Outcome::ALL {
                let n = stats.outcome(outcome);
                text.push_str(&format!("broker_calls_total{{{labels},outcome=\"{}\"}} {n}\n", outcome.name()));
            }
        }
    }
    text.push_str("# HELP broker_call_duration_seconds Call latency, instantiation included.\n");
    text.push_str("# TYPE broker_call_duration_seconds histogram\n");
    for source in sources {
        for (labels, stats) in called(source) {
            for (bound, count) in stats.cumulative() {
                text.push_str(&format!("broker_call_duration_seconds_bucket{{{labels},le=\"{bound}\"}} {count}\n"));
            }
            let count = stats.count();
            text.push_str(&format!("broker_call_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {count}\n"));
            text.push_str(&format!("broker_call_duration_seconds_sum{{{labels}}} {}\n", stats.sum_seconds()));
            text.push_str(&format!("broker_call_duration_seconds_count{{{labels}}} {count}\n"));
        }
    }
}

/// The API described in OpenAPI 3.0 (kept beside this file; a test sends a
/// request to every path and method it names).
pub(crate) const OPENAPI: &str = include_str!("openapi.json");

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LockQuery {
    #[serde(default = "default_limit")]
    history: usize,
}

/// The machine lock: holder, waiters (of every process) and recent history, as `broker lock --json`.
async fn lock_report(State(broker): State<Shared>, Query(query): Query<LockQuery>) -> Response {
    Json(broker.lock().report(query.history.min(1000))).into_response()
}

/// `ok`, or 503 with the store's fault while it refuses writes: a supervisor
/// or a balancer sees that this daemon cannot serve now.
async fn healthz(State(broker): State<Shared>) -> Response {
    match broker.store().health().fault {
        None => "ok\n".into_response(),
        Some(fault) => {
            // Unauthenticated on TCP: the cause, never the data dir's paths.
            let message = format!("the state store refuses writes: {}", fault.os_text());
            let report = ErrorReport::new(ErrorKind::Storage, message);
            ApiError(StatusCode::SERVICE_UNAVAILABLE, report).into_response()
        }
    }
}

/// Prometheus text format: per provider version (serving, or retired within
/// the last ten minutes), its calls, instantiations and breaker; and the swaps so far.
async fn metrics(State(broker): State<Shared>) -> ApiResult<Response> {
    let mut text = String::new();
    let sources = sources(&broker);
    text.push_str("# HELP broker_provider_calls_total Calls begun, per provider version.\n");
    text.push_str("# TYPE broker_provider_calls_total counter\n");
    for source in &sources {
        let calls = source.stats.calls.load(Ordering::Relaxed);
        text.push_str(&format!("broker_provider_calls_total{{{}}} {calls}\n", source.labels));
    }
    text.push_str("# TYPE broker_provider_instantiations_total counter\n");
    for source in &sources {
        let instantiations = source.stats.instantiations.load(Ordering::Relaxed);
        text.push_str(&format!("broker_provider_instantiations_total{{{}}} {instantiations}\n", source.labels));
    }
    text.push_str(
        "# HELP broker_guest_turns_total Turns of executor time the version's long-running calls took (one a millisecond of guest time past the first).\n",
    );
    text.push_str("# TYPE broker_guest_turns_total counter\n");
    for source in &sources {
        let turns = source.stats.turns.load(Ordering::Relaxed);
        text.push_str(&format!("broker_guest_turns_total{{{}}} {turns}\n", source.labels));
    }
    text.push_str("# HELP broker_provider_half_open 1 while the crash policy holds the version half-open.\n");
    text.push_str("# TYPE broker_provider_half_open gauge\n");
    for source in &sources {
        let Some((half_open, trips)) = source.breaker else { continue };
        let labels = &source.labels;
        text.push_str(&format!("broker_provider_half_open{{{labels}}} {}\n", u8::from(half_open)));
        text.push_str(&format!("broker_provider_breaker_trips_total{{{labels}}} {trips}\n"));
    }
    per_method(&mut text, &sources);
    text.push_str(
        "# HELP broker_quota_refusals_total What a provider's bounds refused or cut (calls, lines, entries), by bound.\n",
    );
    text.push_str("# TYPE broker_quota_refusals_total counter\n");
    for source in &sources {
        for (quota, n) in source.stats.quotas.iter() {
            text.push_str(&format!(
                "broker_quota_refusals_total{{{},quota=\"{}\"}} {n}\n",
                source.labels,
                quota.name()
            ));
        }
    }
    let mirror = broker.store().kv().mirror_stats();
    let health = broker.store().health();
    let swaps = broker.registry().swap_counts();
    let host_wide: [(&str, &str, &str, u64); 10] = [
        (
            "broker_kv_mirror_bytes",
            "gauge",
            "Keys and values of the kv namespaces held in memory.",
            mirror.bytes as u64,
        ),
        ("broker_kv_mirror_namespaces", "gauge", "Kv namespaces held in memory.", mirror.namespaces as u64),
        (
            "broker_kv_mirror_loads_total",
            "counter",
            "Kv namespaces read from the state file into memory.",
            mirror.loads,
        ),
        (
            "broker_kv_mirror_evictions_total",
            "counter",
            "Clean kv namespaces let go of memory to keep within the mirror's budget.",
            mirror.evictions,
        ),
        (
            "broker_store_faulted",
            "gauge",
            "1 while the state file or its log is faulted and writes are refused.",
            u64::from(health.fault.is_some()),
        ),
        (
            "broker_store_faults_total",
            "counter",
            "I/O failures of the state file or its log that made the host refuse writes.",
            health.faults,
        ),
        (
            "broker_store_reopens_total",
            "counter",
            "Faults of the state file or its log that ended (a reopen, a settled log).",
            health.heals,
        ),
        (
            "broker_swaps_total",
            "counter",
            "Providers swapped since the daemon started.",
            swaps.swapped.load(Ordering::Relaxed),
        ),
        (
            "broker_swap_refusals_total",
            "counter",
            "Swap candidates refused since the daemon started.",
            swaps.refused.load(Ordering::Relaxed),
        ),
        (
            "broker_store_faulted_seconds",
            "gauge",
            "How long the current fault has lasted (0: none).",
            fault_seconds(&health),
        ),
    ];
    for (name, kind, help, value) in host_wide {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"));
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// How long the store's current fault has lasted, in whole seconds.
fn fault_seconds(health: &broker_core::store::Health) -> u64 {
    health.fault.as_ref().map_or(0, |fault| fault.since.elapsed().unwrap_or_default().as_secs())
}

#[cfg(test)]
mod route_list {
    /// `openapi.json` documents exactly the routes the router serves: a route
    /// added, removed or renamed without its document fails here.
    #[test]
    fn the_openapi_document_has_every_route_and_no_other() {
        let document: serde_json::Value = serde_json::from_str(super::OPENAPI).unwrap();
        let mut documented: Vec<(String, String)> = Vec::new();
        for (path, item) in document["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys().filter(|key| *key != "parameters") {
                documented.push((method.to_uppercase(), path.clone()));
            }
        }
        let mut routed: Vec<(String, String)> =
            super::routes().iter().map(|r| (r.method.to_owned(), r.path.to_owned())).collect();
        documented.sort();
        routed.sort();
        assert_eq!(routed.len(), 24);
        assert_eq!(documented, routed);
    }

    /// Every error kind the host reports is documented, and no other.
    #[test]
    fn the_openapi_document_lists_every_error_kind() {
        let document: serde_json::Value = serde_json::from_str(super::OPENAPI).unwrap();
        let documented = &document["components"]["schemas"]["ErrorReport"]["properties"]["kind"]["enum"];
        let kinds: Vec<&str> = broker_core::error_report::ErrorKind::ALL.iter().map(|kind| kind.name()).collect();
        assert_eq!(documented, &serde_json::json!(kinds));
    }
}

#[cfg(test)]
mod fuzz {
    use axum::body::Body;
    use axum::http::Request;
    use broker_core::broker::Broker;
    use tower::ServiceExt;

    /// Fuzzed (bolero): any body, to any route that takes one, any query,
    /// is answered 2xx or 4xx with `{"error": {"kind", "message"}}` JSON: never a 5xx, never a
    /// panic. (A broker with no providers: every start or add fails early,
    /// which is the code under attack here.)
    #[test]
    fn fuzz_api_requests() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let broker = std::sync::Arc::new(Broker::open(dir.path()).unwrap());
        let groups = broker_core::groups::Groups::new(broker.clone(), Default::default());
        let app = super::router_with(broker, groups, Default::default(), std::time::Duration::from_secs(1));
        // A panic is the failure bolero reports: the router is never used after one.
        let (app, runtime) = (std::panic::AssertUnwindSafe(app), std::panic::AssertUnwindSafe(runtime));
        let routes = [
            ("POST", "/v1/instances"),
            ("POST", "/v1/providers"),
            ("POST", "/v1/providers/fake/swap"),
            ("GET", "/v1/instances?"),
            ("GET", "/v1/events?"),
            ("GET", "/v1/lock?"),
            ("DELETE", "/v1/instances/"),
        ];
        bolero::check!().with_iterations(3_000).with_type::<(u8, Vec<u8>, String)>().for_each(
            |(route, body, query)| {
                let (method, path) = routes[usize::from(*route) % routes.len()];
                let encoded: String = url_safe(query);
                let uri = if path.ends_with(['?', '/']) { format!("{path}{encoded}") } else { path.to_owned() };
                let Ok(request) = Request::builder()
                    .method(method)
                    .uri(&uri)
                    .header("content-type", "application/json")
                    .body(Body::from(body.clone()))
                else {
                    return;
                };
                // Through the wrapper (a whole capture), not its field.
                let router = std::ops::Deref::deref(&app).clone();
                let response = runtime.block_on(router.oneshot(request)).unwrap();
                let status = response.status();
                assert!(!status.is_server_error(), "{method} {uri}: {status}");
                if status.is_client_error() {
                    let bytes = runtime.block_on(axum::body::to_bytes(response.into_body(), 1 << 20)).unwrap();
                    let answer: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                    let error = &answer["error"];
                    assert!(error["kind"].is_string() && error["message"].is_string(), "{method} {uri}: {answer}");
                }
            },
        );
    }

    /// `text` as a URI may carry it: what is not unreserved is %-escaped.
    fn url_safe(text: &str) -> String {
        text.bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'=' | b'&' => {
                    (b as char).to_string()
                }
                other => format!("%{other:02X}"),
            })
            .collect()
    }
}
