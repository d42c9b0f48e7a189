//! [`JsonObject`]: a JSON object kept as its text.
//!
//! Checkpoint states are written after every step and read back only on resume, so they travel
//! worker → store → database as text: decoding checks the syntax and that the value is an object,
//! but builds no map, and encoding copies the text. Whoever needs the fields parses on demand
//! ([`JsonObject::parse`], [`JsonObject::to_map`]).
//!
//! # Invariants
//! - The text is always one syntactically valid JSON object (checked by every constructor).
//! - Equality is JSON equality: the same text is equal at once; otherwise both sides are parsed
//!   and compared as values (two encodings of one object may differ in spacing and key order).

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// One JSON object, held as text.
#[derive(Debug, Clone)]
pub struct JsonObject(Box<RawValue>);

impl JsonObject {
    /// `{}`.
    pub fn empty() -> JsonObject {
        match RawValue::from_string("{}".to_owned()) {
            Ok(raw) => JsonObject(raw),
            Err(_) => unreachable!("`{{}}` is JSON"),
        }
    }

    /// Checks that `text` is one JSON object and keeps it as given.
    pub fn from_text(text: String) -> Result<JsonObject, serde_json::Error> {
        let raw = RawValue::from_string(text)?;
        Self::object(raw).map_err(serde_json::Error::custom)
    }

    /// Encodes `value`, which must encode as an object (any struct or map does).
    pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<JsonObject, serde_json::Error> {
        let raw = serde_json::value::to_raw_value(value)?;
        Self::object(raw).map_err(serde_json::Error::custom)
    }

    /// The object built from `map`.
    pub fn from_map(map: &Map<String, Value>) -> JsonObject {
        // A map of JSON values always encodes, and always as an object.
        match serde_json::value::to_raw_value(map) {
            Ok(raw) => JsonObject(raw),
            Err(_) => JsonObject::empty(),
        }
    }

    /// Decodes the object as `T`.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.0.get())
    }

    /// The object's fields.
    pub fn to_map(&self) -> Map<String, Value> {
        // Checked to be an object on construction.
        self.parse().unwrap_or_default()
    }

    /// The JSON text.
    pub fn as_str(&self) -> &str {
        self.0.get()
    }

    /// The JSON text, owned.
    pub fn into_string(self) -> String {
        let boxed: Box<str> = self.0.into();
        boxed.into()
    }

    fn object(raw: Box<RawValue>) -> Result<JsonObject, &'static str> {
        if raw.get().trim_start().starts_with('{') {
            Ok(JsonObject(raw))
        } else {
            Err("expected a JSON object")
        }
    }
}

impl Default for JsonObject {
    fn default() -> Self {
        JsonObject::empty()
    }
}

impl PartialEq for JsonObject {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
            || serde_json::from_str::<Value>(self.as_str()).ok()
                == serde_json::from_str::<Value>(other.as_str()).ok()
    }
}

impl From<Map<String, Value>> for JsonObject {
    fn from(map: Map<String, Value>) -> Self {
        JsonObject::from_map(&map)
    }
}

impl Serialize for JsonObject {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for JsonObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(deserializer)?;
        JsonObject::object(raw).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Debug, Deserialize, Serialize, PartialEq)]
    struct Holder {
        state: JsonObject,
    }

    #[test]
    fn keeps_the_text_and_refuses_non_objects() {
        let h: Holder = serde_json::from_str(r#"{"state": {"b":1, "a":[true]}}"#).unwrap();
        assert_eq!(h.state.as_str(), r#"{"b":1, "a":[true]}"#);
        assert_eq!(
            serde_json::to_string(&h).unwrap(),
            r#"{"state":{"b":1, "a":[true]}}"#
        );
        for bad in [
            r#"{"state":[1]}"#,
            r#"{"state":"x"}"#,
            r#"{"state":{"a":}}"#,
        ] {
            assert!(serde_json::from_str::<Holder>(bad).is_err(), "{bad}");
        }
        assert!(JsonObject::from_text("[]".into()).is_err());
        assert!(JsonObject::encode(&3).is_err());
    }

    #[test]
    fn equality_is_json_equality() {
        let a = JsonObject::from_text(r#"{"a":1,"bb":[1,2]}"#.into()).unwrap();
        let b = JsonObject::from_text(r#"{"bb": [1, 2], "a": 1}"#.into()).unwrap();
        let c = JsonObject::from_text(r#"{"a":2,"bb":[1,2]}"#.into()).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(
            a.to_map(),
            json!({"a":1,"bb":[1,2]}).as_object().unwrap().clone()
        );
        assert_eq!(JsonObject::from(a.to_map()), a);
        assert_eq!(JsonObject::default().as_str(), "{}");
    }

    #[test]
    fn decodes_from_a_value_too() {
        let h: Holder = serde_json::from_value(json!({"state": {"k": "v"}})).unwrap();
        assert_eq!(h.state.to_map()["k"], "v");
    }
}
