//! JSON-RPC 2.0 as InfraKit's plugins speak it (gorilla/rpc's json2 codec):
//! one `POST /` per call, `params` an object (or an array holding one), the
//! caller's `id` (a number up to 2^63, or a string) echoed, and a failed
//! call's `error` as `{"code": -32000, "message": …}`.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The body is not JSON.
pub const PARSE_ERROR: i64 = -32700;
/// JSON, but not a JSON-RPC request.
pub(crate) const INVALID_REQUEST: i64 = -32600;
/// No such method on this plugin.
pub const METHOD_NOT_FOUND: i64 = -32601;
/// The params are not the method's.
pub const INVALID_PARAMS: i64 = -32602;
/// The call ran and failed: InfraKit's code for every plugin error.
pub const SERVER_ERROR: i64 = -32000;

/// A call's failure, as it goes on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{message} (JSON-RPC error {code})")]
pub struct RpcError {
    /// One of the codes above.
    pub code: i64,
    /// What went wrong, for a person.
    pub message: String,
}

impl RpcError {
    /// A plugin error (`-32000`), said as the host says errors.
    pub(crate) fn server(error: &(dyn std::error::Error + 'static)) -> RpcError {
        RpcError { code: SERVER_ERROR, message: broker_capabilities::error_text::error_text(error) }
    }

    /// Params that are not the method's.
    pub(crate) fn params(why: impl std::fmt::Display) -> RpcError {
        RpcError { code: INVALID_PARAMS, message: format!("invalid params: {why}") }
    }
}

/// A request, read leniently enough to answer even a bad one with its id.
#[derive(Debug, Deserialize)]
pub(crate) struct Request {
    /// `"2.0"`; absent is taken as 2.0, as gorilla does.
    #[serde(default)]
    pub(crate) jsonrpc: Option<String>,
    /// `Interface.Method`.
    pub(crate) method: String,
    /// An object, or an array of one object.
    #[serde(default)]
    pub(crate) params: Value,
    /// Echoed in the answer.
    #[serde(default)]
    pub(crate) id: Value,
}

/// The answer to one request.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Response {
    /// Always `"2.0"`.
    pub(crate) jsonrpc: String,
    /// The method's result, when it succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) result: Option<Value>,
    /// Why it failed, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<RpcError>,
    /// The request's id.
    pub(crate) id: Value,
}

impl Response {
    /// The answer of `outcome` to the request of `id`.
    pub(crate) fn of(id: Value, outcome: Result<Value, RpcError>) -> Response {
        match outcome {
            Ok(result) => Response { jsonrpc: "2.0".into(), result: Some(result), error: None, id },
            Err(error) => Response { jsonrpc: "2.0".into(), result: None, error: Some(error), id },
        }
    }
}

/// Read a request from `body`: the request, or the answer to send at once.
pub(crate) fn read_request(body: &[u8]) -> Result<Request, Response> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        Response::of(Value::Null, Err(RpcError { code: PARSE_ERROR, message: format!("the body is not JSON: {e}") }))
    })?;
    let id = value.get("id").cloned().unwrap_or(Value::Null);
    let invalid = |why: String| Response::of(id.clone(), Err(RpcError { code: INVALID_REQUEST, message: why }));
    let request: Request =
        serde_json::from_value(value).map_err(|e| invalid(format!("not a JSON-RPC request: {e}")))?;
    if request.jsonrpc.as_deref().is_some_and(|v| v != "2.0") {
        return Err(invalid(format!("jsonrpc {:?}: only 2.0 is spoken", request.jsonrpc.unwrap_or_default())));
    }
    if !matches!(request.id, Value::Null | Value::Number(_) | Value::String(_)) {
        return Err(invalid("id must be a number or a string".into()));
    }
    Ok(request)
}

/// A field InfraKit's Go clients may send as `null` (a nil map or slice):
/// read as its default, as Go's decoder does.
pub(crate) fn or_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// A method's params as `T` (fields it does not know are ignored, as
/// InfraKit's servers do: a newer client's extra field breaks nothing): an object, or an array holding exactly one.
pub(crate) fn params<T: DeserializeOwned>(params: Value) -> Result<T, RpcError> {
    let object = match params {
        Value::Array(mut items) if items.len() == 1 => items.remove(0),
        Value::Array(items) => {
            return Err(RpcError::params(format!("an array of {} params; give one object", items.len())));
        }
        Value::Null => Value::Object(serde_json::Map::new()),
        other => other,
    };
    serde_json::from_value(object).map_err(RpcError::params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Sized {
        #[serde(rename = "ID")]
        id: String,
        #[serde(rename = "Instances", default, deserialize_with = "or_default")]
        instances: Vec<String>,
    }

    #[test]
    fn params_are_an_object_or_an_array_of_one() {
        let want = Sized { id: "w".into(), instances: Vec::new() };
        assert_eq!(params::<Sized>(serde_json::json!({"ID": "w"})).unwrap(), want);
        assert_eq!(params::<Sized>(serde_json::json!([{"ID": "w"}])).unwrap(), want);
        let two = params::<Sized>(serde_json::json!([{"ID": "w"}, {"ID": "x"}])).unwrap_err();
        assert_eq!(two.code, INVALID_PARAMS);
        // As Go clients send them: a nil slice is null, a newer field is ignored.
        assert_eq!(params::<Sized>(serde_json::json!({"ID": "w", "Instances": null, "Newer": 1})).unwrap(), want);
        let wrong = params::<Sized>(serde_json::json!({"ID": 5})).unwrap_err();
        assert_eq!(wrong.code, INVALID_PARAMS, "{wrong:?}");
    }

    #[test]
    fn bad_requests_are_answered_with_their_id_and_code() {
        let garbage = read_request(b"{not json").unwrap_err();
        assert_eq!((garbage.error.unwrap().code, garbage.id), (PARSE_ERROR, Value::Null));
        let no_method = read_request(br#"{"jsonrpc": "2.0", "id": 9223372036854775808}"#).unwrap_err();
        assert_eq!(no_method.error.unwrap().code, INVALID_REQUEST);
        assert_eq!(no_method.id.to_string(), "9223372036854775808", "an id of 2^63 comes back exact");
        let old = read_request(br#"{"jsonrpc": "1.0", "method": "Group.Size", "id": 1}"#).unwrap_err();
        assert_eq!(old.error.unwrap().code, INVALID_REQUEST);
        let object_id = read_request(br#"{"method": "Group.Size", "id": {}}"#).unwrap_err();
        assert_eq!(object_id.error.unwrap().code, INVALID_REQUEST);
        let good = read_request(br#"{"jsonrpc": "2.0", "method": "Group.Size", "params": {}, "id": "a"}"#).unwrap();
        assert_eq!((good.method.as_str(), good.id), ("Group.Size", Value::String("a".into())));
    }
}
