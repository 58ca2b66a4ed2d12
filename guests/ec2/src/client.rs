//! EC2's Query API through the SDK's HTTP client: a form POSTed to `/` on the
//! granted authority, unsigned (the host signs), an XML answer read back.

use broker_guest::host_kv;
use broker_guest::host_log;
use broker_guest::http::{Error, ErrorCode, Request};
use broker_guest::types::BrokerError;
use ec2_logic::api::{self, Ec2Instance};
use ec2_logic::query::{self, Form};
use ec2_logic::select::Zone;
use ec2_logic::{Config, Ec2Error};
use std::time::Duration;

/// EC2's answers are small; a page of 1000 instances stays well under this.
const MAX_BODY: usize = 4 << 20;
/// Ids per `DescribeInstances` filter or `TerminateInstances` call.
pub const MAX_IDS_PER_CALL: usize = 200;
/// At most this many `DescribeInstances` pages.
const MAX_PAGES: usize = 1000;
/// The states `all-instances` lists (terminated ones are gone).
const LIVE_STATES: [&str; 5] = ["pending", "running", "shutting-down", "stopping", "stopped"];

pub fn from_logic(err: Ec2Error) -> BrokerError {
    match err {
        Ec2Error::InvalidParams(m) => BrokerError::InvalidParams(m),
        Ec2Error::NotFound(m) => BrokerError::NotFound(m),
        Ec2Error::ZoneUnavailable(m) => BrokerError::ZoneUnavailable(m),
        Ec2Error::ZoneIndependent(m) => BrokerError::ZoneIndependent(m),
        Ec2Error::AccessDenied(m) => BrokerError::AccessDenied(m),
        Ec2Error::Provider(m) => BrokerError::Provider(m),
    }
}

pub struct Ec2 {
    pub config: Config,
}

/// Why a request failed: worth the same request again (a lost answer, a 5xx,
/// throttling), or not.
#[derive(Debug)]
pub enum Failure {
    Transient(BrokerError),
    Final(BrokerError),
}

impl From<Failure> for BrokerError {
    fn from(failure: Failure) -> BrokerError {
        match failure {
            Failure::Transient(error) | Failure::Final(error) => error,
        }
    }
}

/// Tries of a request whose answer may be lost (RunInstances with its token).
const TRIES: u32 = 3;

impl Ec2 {
    pub fn new(config: Config) -> Ec2 {
        Ec2 { config }
    }

    /// One action; an error answer as the contract's kind.
    pub fn call(&self, form: &Form) -> Result<String, BrokerError> {
        self.send(form).map_err(BrokerError::from)
    }

    /// One action, its failure marked transient when the same request may yet succeed.
    fn send(&self, form: &Form) -> Result<String, Failure> {
        let action = form.iter().find(|(k, _)| k == "Action").map(|(_, v)| v.as_str()).unwrap_or("?");
        let pairs: Vec<(&str, &str)> = form.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let sent = Request::post(&self.config.authority, "/")
            .form(&pairs)
            .timeout(Duration::from_secs(self.config.request_timeout_s))
            .max_response(MAX_BODY)
            .send();
        let answer = match sent {
            Ok(answer) => answer,
            Err(Error::Http(ErrorCode::HttpRequestDenied)) => {
                return Err(Failure::Final(BrokerError::AccessDenied(format!(
                    "{action}: the host refused it (authority {:?} not granted, or the grant's rules refuse this request)",
                    self.config.authority
                ))));
            }
            // The answer may have been lost on the way: the request may yet have done its work.
            Err(err) => return Err(Failure::Transient(BrokerError::Provider(format!("{action}: {err}")))),
        };
        let body = String::from_utf8_lossy(&answer.body).into_owned();
        if !answer.is_success() {
            let error = from_logic(api::error(answer.status, &body)).map_message(|m| format!("{action}: {m}"));
            return Err(match api::transient(answer.status, &body) {
                true => Failure::Transient(error),
                false => Failure::Final(error),
            });
        }
        Ok(body)
    }

    /// The region's zones; their names are kept for `describe`.
    pub fn zones(&self) -> Result<Vec<Zone>, BrokerError> {
        let zones = api::availability_zones(&self.call(&query::describe_availability_zones())?).map_err(from_logic)?;
        let mut names: Vec<&str> = zones.iter().filter(|z| z.state == "available").map(|z| z.name.as_str()).collect();
        names.retain(|n| self.config.zones.is_empty() || self.config.zones.iter().any(|z| z == n));
        names.sort_unstable();
        let listed = names.join("\n");
        if host_kv::get(super::ZONES_KEY).ok().flatten().as_deref() != Some(listed.as_bytes()) {
            host_kv::set(super::ZONES_KEY, listed.as_bytes())?;
        }
        Ok(zones)
    }

    fn namespace_filter(&self) -> (String, Vec<String>) {
        (format!("tag:{}", self.config.tag_key), vec![self.config.namespace.clone()])
    }

    /// Every instance matching `filters` (plus this namespace's tag), page by page.
    fn describe(&self, extra: &[(&str, Vec<String>)]) -> Result<Vec<Ec2Instance>, Failure> {
        let (tag, value) = self.namespace_filter();
        let mut filters: Vec<(&str, Vec<String>)> = vec![(tag.as_str(), value)];
        filters.extend(extra.iter().cloned());
        let mut out = Vec::new();
        let mut next: Option<String> = None;
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..MAX_PAGES {
            let page_size = self.config.describe_page_size;
            let body = self.send(&query::describe_instances(&filters, next.as_deref(), page_size))?;
            let (page, token) = api::describe_instances(&body).map_err(|e| Failure::Final(from_logic(e)))?;
            out.extend(page);
            match token {
                // A token seen before would page in a circle.
                Some(token) if seen.insert(token.clone()) => next = Some(token),
                Some(_) => {
                    return Err(Failure::Final(BrokerError::Provider(
                        "DescribeInstances: a nextToken came round again".into(),
                    )));
                }
                None => return Ok(out),
            }
        }
        Err(Failure::Final(BrokerError::Provider(format!("DescribeInstances: more than {MAX_PAGES} pages"))))
    }

    /// Those of `ids` that carry this namespace's tag (any state).
    pub fn ours(&self, ids: &[String]) -> Result<Vec<Ec2Instance>, Failure> {
        let mut out = Vec::new();
        for chunk in ids.chunks(MAX_IDS_PER_CALL) {
            out.extend(self.describe(&[("instance-id", chunk.to_vec())])?);
        }
        Ok(out)
    }

    /// Every live instance of this namespace.
    pub fn all(&self) -> Result<Vec<Ec2Instance>, BrokerError> {
        Ok(self.describe(&[("instance-state-name", LIVE_STATES.iter().map(|s| (*s).to_owned()).collect())])?)
    }

    /// `RunInstances` of one instance; its id. A lost answer or a 5xx is
    /// asked again with the same `ClientToken`: EC2 answers a repeat with the
    /// instance the first made, never a second one.
    pub fn run(&self, spec: &query::RunSpec) -> Result<Ec2Instance, BrokerError> {
        let form = query::run_instances(spec);
        let mut attempt = 1;
        let body = loop {
            match self.send(&form) {
                Ok(body) => break body,
                Err(Failure::Transient(error)) if attempt < TRIES => {
                    host_log::log(host_log::Level::Warn, &format!("{}; asking again (same token)", error.message()));
                    crate::sleep(Duration::from_secs(u64::from(attempt)));
                    attempt += 1;
                }
                Err(failure) => return Err(failure.into()),
            }
        };
        let made = api::run_instances(&body).map_err(from_logic)?;
        match <[Ec2Instance; 1]>::try_from(made) {
            Ok([one]) => Ok(one),
            Err(made) => Err(BrokerError::Provider(format!("RunInstances answered {} instances, not 1", made.len()))),
        }
    }

    pub fn terminate(&self, ids: &[String]) -> Result<(), BrokerError> {
        self.call(&query::terminate_instances(ids)).map(drop)
    }

    /// Terminate an instance this start made and will not return.
    pub fn terminate_logged(&self, id: &str, why: &str) {
        if let Err(err) = self.terminate(&[id.to_owned()]) {
            host_log::log(host_log::Level::Warn, &format!("terminating {id} ({why}): {}", err.message()));
        }
    }
}
