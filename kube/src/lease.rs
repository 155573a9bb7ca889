//! coordination.k8s.io/v1 Leases: the objects proxy-servers publish to say
//! they are alive, and the calls on them.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::client::KubeClient;
use crate::error::KubeError;
use crate::reflector::{Collection, Object, ObjectList, query_escape};

/// A Lease, with the fields the proxy reads or writes named; every other
/// field kube-apiserver sends (annotations, owner references, newer spec
/// fields) is kept as it came, so that an update, which replaces the whole
/// object, does not erase what someone else wrote.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: LeaseSpec,
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Sent back on update, so that kube-apiserver refuses it (409) when the
    /// Lease changed since it was read.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub resource_version: String,
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LeaseSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_identity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_duration_seconds: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquire_time: Option<MicroTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<MicroTime>,
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

impl Lease {
    /// Whether the holder still holds it at `now`, by upstream's rule: the
    /// last renewal (else the acquisition) plus the duration is after `now`;
    /// a Lease with neither time, or no duration, has expired.
    pub fn is_valid(&self, now: SystemTime) -> bool {
        let Some(last) = self.spec.renew_time.or(self.spec.acquire_time) else {
            return false;
        };
        let seconds = self.spec.lease_duration_seconds.unwrap_or(0).max(0);
        last.0 + Duration::from_secs(seconds as u64) > now
    }
}

/// A point in time as Kubernetes writes `MicroTime` fields: RFC 3339 in UTC
/// with exactly six fractional digits (Go's parser wants all six).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct MicroTime(pub SystemTime);

impl MicroTime {
    pub fn now() -> MicroTime {
        MicroTime(SystemTime::now())
    }
}

impl Serialize for MicroTime {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let at = time::OffsetDateTime::from(self.0);
        let text = format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
            at.year(),
            u8::from(at.month()),
            at.day(),
            at.hour(),
            at.minute(),
            at.second(),
            at.microsecond()
        );
        serializer.serialize_str(&text)
    }
}

impl<'de> Deserialize<'de> for MicroTime {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        let at = time::OffsetDateTime::parse(&text, &time::format_description::well_known::Rfc3339)
            .map_err(|e| serde::de::Error::custom(format!("time {text:?}: {e}")))?;
        Ok(MicroTime(at.into()))
    }
}

/// The Leases of one namespace.
pub struct Leases<'a> {
    client: &'a KubeClient,
    namespace: &'a str,
}

impl<'a> Leases<'a> {
    pub fn new(client: &'a KubeClient, namespace: &'a str) -> Leases<'a> {
        Leases { client, namespace }
    }

    fn collection(&self) -> String {
        format!(
            "/apis/coordination.k8s.io/v1/namespaces/{}/leases",
            query_escape(self.namespace)
        )
    }

    fn item(&self, name: &str) -> String {
        format!("{}/{}", self.collection(), query_escape(name))
    }

    pub async fn get(&self, name: &str) -> Result<Lease, KubeError> {
        self.client.get(&self.item(name)).await
    }

    pub async fn create(&self, lease: &Lease) -> Result<Lease, KubeError> {
        self.client.post(&self.collection(), &with_kind(lease)).await
    }

    /// Replaces the Lease; refused with 409 Conflict when its
    /// resourceVersion is not the stored one.
    pub async fn update(&self, lease: &Lease) -> Result<Lease, KubeError> {
        self.client
            .put(&self.item(&lease.metadata.name), &with_kind(lease))
            .await
    }

    /// Deletes the Lease; with `resource_version`, only if it is still that
    /// version (409 Conflict otherwise), so a renewal in between wins.
    pub async fn delete(&self, name: &str, resource_version: Option<&str>) -> Result<(), KubeError> {
        let options = resource_version.map(|version| {
            serde_json::json!({
                "kind": "DeleteOptions",
                "apiVersion": "v1",
                "preconditions": {"resourceVersion": version},
            })
        });
        self.client.delete(&self.item(name), options.as_ref()).await
    }

    pub async fn list(&self, label_selector: &str) -> Result<ObjectList<Lease>, KubeError> {
        self.client.get(&self.matching(label_selector).list_path()).await
    }

    /// The Leases matching `label_selector`, to follow with a
    /// [`crate::reflector::Reflector`].
    pub fn matching(&self, label_selector: &str) -> Collection {
        Collection {
            path: self.collection(),
            label_selector: label_selector.to_owned(),
        }
    }
}

impl Object for Lease {
    fn resource_version(&self) -> &str {
        &self.metadata.resource_version
    }
}

/// A Lease as a request body: kube-apiserver wants its kind and version.
fn with_kind(lease: &Lease) -> Lease {
    let mut lease = lease.clone();
    lease
        .other
        .insert("apiVersion".to_owned(), "coordination.k8s.io/v1".into());
    lease.other.insert("kind".to_owned(), "Lease".into());
    lease
}

/// Labels as a selector that matches them all, keys in order (as
/// apimachinery's `labels.FormatLabels`).
pub fn selector(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_time_has_six_fractional_digits_and_reads_back() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let text = serde_json::to_string(&MicroTime(at)).unwrap();
        assert_eq!(text, "\"2023-11-14T22:13:20.123456Z\"");
        let back: MicroTime = serde_json::from_str(&text).unwrap();
        assert_eq!(
            back.0,
            SystemTime::UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_000)
        );
        // kube-apiserver may send other offsets and precisions.
        let other: MicroTime = serde_json::from_str("\"2023-11-14T23:13:20+01:00\"").unwrap();
        assert_eq!(
            other.0,
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
        );
    }

    #[test]
    fn a_lease_is_valid_until_its_last_renewal_plus_its_duration() {
        let base = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut lease = Lease::default();
        assert!(!lease.is_valid(base), "no times: expired");
        lease.spec.lease_duration_seconds = Some(30);
        lease.spec.acquire_time = Some(MicroTime(base));
        assert!(lease.is_valid(base + Duration::from_secs(29)));
        assert!(!lease.is_valid(base + Duration::from_secs(30)));
        // The renewal, when there is one, counts rather than the acquisition.
        lease.spec.renew_time = Some(MicroTime(base + Duration::from_secs(20)));
        assert!(lease.is_valid(base + Duration::from_secs(49)));
        assert!(!lease.is_valid(base + Duration::from_secs(50)));
    }

    #[test]
    fn fields_not_named_here_are_kept_for_the_update() {
        let text = r#"{"apiVersion":"coordination.k8s.io/v1","kind":"Lease",
            "metadata":{"name":"l","resourceVersion":"7","annotations":{"a":"b"},"uid":"u"},
            "spec":{"holderIdentity":"s","leaseDurationSeconds":30,"strategy":"x"}}"#;
        let lease: Lease = serde_json::from_str(text).unwrap();
        let back = serde_json::to_value(&lease).unwrap();
        assert_eq!(back["metadata"]["annotations"]["a"], "b");
        assert_eq!(back["metadata"]["uid"], "u");
        assert_eq!(back["spec"]["strategy"], "x");
        assert_eq!(back["metadata"]["resourceVersion"], "7");
    }

    #[test]
    fn selectors_escape_and_list_labels_in_key_order() {
        let labels = BTreeMap::from([
            ("k8s-app".to_owned(), "konnectivity-server".to_owned()),
            ("a".to_owned(), "b".to_owned()),
        ]);
        assert_eq!(selector(&labels), "a=b,k8s-app=konnectivity-server");
        assert_eq!(query_escape("a=b,c=d"), "a%3Db%2Cc%3Dd");
    }
}
