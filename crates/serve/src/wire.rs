//! What the API's streaming answers carry, shared by the daemon that writes
//! them and the CLI that reads them.

use broker_capabilities::rooms::context::CallEvent;
use broker_core::error_report::{ErrorKind, ErrorReport};
use broker_core::store::InstanceRecord;
use broker_core::store::records::{status_from_name, status_name};
use serde::{Deserialize, Serialize};

/// One NDJSON line of `POST /v1/instances`: status updates as the provider
/// reports them, then exactly one `started` or `failed`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub(crate) enum StartLine {
    Status {
        status: String,
        info: String,
        data: Vec<(String, String)>,
    },
    Cleanup {
        info: String,
    },
    Started {
        instance: Box<InstanceRecord>,
    },
    Failed {
        #[serde(deserialize_with = "report_or_text")]
        error: ErrorReport,
    },
}

/// Every error answer's body: `{"error": {"kind", "message", "provider", "method", "instance"}}`.
pub(crate) fn error_body(report: &ErrorReport) -> serde_json::Value {
    serde_json::json!({ "error": report })
}

/// The report in an error answer's body, if it has one: an object, or an
/// older daemon's text alone (of kind `other`).
pub(crate) fn error_in_body(body: &[u8]) -> Option<ErrorReport> {
    #[derive(Deserialize)]
    struct Body {
        #[serde(deserialize_with = "report_or_text")]
        error: ErrorReport,
    }
    serde_json::from_slice::<Body>(body).ok().map(|body| body.error)
}

fn report_or_text<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<ErrorReport, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Report(ErrorReport),
        Text(String),
    }
    Ok(match Either::deserialize(deserializer)? {
        Either::Report(report) => report,
        Either::Text(text) => ErrorReport::new(ErrorKind::Other, text),
    })
}

impl From<CallEvent> for StartLine {
    fn from(event: CallEvent) -> Self {
        match event {
            CallEvent::Status { status, info, data } => {
                StartLine::Status { status: status_name(status).to_owned(), info, data }
            }
            CallEvent::Cleanup { info } => StartLine::Cleanup { info },
        }
    }
}

impl StartLine {
    /// The call event this line reports, if it is one (an unknown status name is
    /// not: the daemon only writes names `status_name` gives).
    pub(crate) fn call_event(&self) -> Option<CallEvent> {
        match self {
            StartLine::Status { status, info, data } => {
                Some(CallEvent::Status { status: status_from_name(status)?, info: info.clone(), data: data.clone() })
            }
            StartLine::Cleanup { info } => Some(CallEvent::Cleanup { info: info.clone() }),
            StartLine::Started { .. } | StartLine::Failed { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_capabilities::bindings::InstanceStatus;

    #[test]
    fn a_status_line_keeps_its_wire_shape_and_reads_back() {
        let event = CallEvent::Status {
            status: InstanceStatus::ProvisioningError,
            info: "Creating container: boom".into(),
            data: vec![("k".into(), "v".into())],
        };
        let line = serde_json::to_value(StartLine::from(event.clone())).unwrap();
        assert_eq!(
            line,
            serde_json::json!({"event": "status", "status": "provisioning-error",
                               "info": "Creating container: boom", "data": [["k", "v"]]})
        );
        let back: StartLine = serde_json::from_value(line).unwrap();
        assert_eq!(back.call_event(), Some(event));
        let failed: StartLine = serde_json::from_str(r#"{"event":"failed","error":"no"}"#).unwrap();
        let no = ErrorReport::new(ErrorKind::Other, "no");
        assert_eq!((failed.call_event(), failed), (None, StartLine::Failed { error: no.clone() }));
        let report = ErrorReport::new(ErrorKind::ZoneUnavailable, "zone a is full").about_provider("lxd");
        let line = serde_json::to_value(StartLine::Failed { error: report.clone() }).unwrap();
        assert_eq!(
            line,
            serde_json::json!({"event": "failed", "error": {"kind": "zone-unavailable", "message": "zone a is full", "provider": "lxd"}})
        );
        assert_eq!(serde_json::from_value::<StartLine>(line).unwrap(), StartLine::Failed { error: report.clone() });
        assert_eq!(error_in_body(error_body(&report).to_string().as_bytes()), Some(report));
        assert_eq!(error_in_body(br#"{"error":"no"}"#), Some(no));
        assert_eq!(error_in_body(b"upstream gone"), None);
    }
}
