//! [`JsonObject`]: a JSON object kept as its text.
//!
//! Checkpoint states are written after every step and read back only on resume, so they travel
//! worker → store → database as text: decoding checks the syntax and that the value is an object,
//! but builds no map, and encoding copies the text. Whoever needs the fields parses on demand
//! ([`JsonObject::parse`], [`JsonObject::to_map`]).
//!
//! # Invariants
//! - The text is always one syntactically valid JSON object (checked by every constructor) that
//!   every reader here can parse: at most [`MAX_DEPTH`] levels deep and no number outside `f64`
//!   (serde_json checks neither when it only checks the syntax, but refuses both when it builds a
//!   value: a state stored with either could never be read back).
//! - Equality is JSON equality: the same text is equal at once; otherwise both sides are parsed
//!   and compared as values (two encodings of one object may differ in spacing and key order).

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// The deepest nesting a [`JsonObject`] may have: serde_json refuses more than 127 levels when
/// it builds a value, and a state travels inside envelopes (a checkpoint in a list page is three
/// levels down).
pub const MAX_DEPTH: usize = 100;

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
        if !raw.get().trim_start().starts_with('{') {
            return Err("expected a JSON object");
        }
        readable(raw.get())?;
        Ok(JsonObject(raw))
    }
}

/// Whether syntactically valid JSON `text` can also be parsed into a value: one pass over the
/// bytes, no allocation (see the module's invariants).
fn readable(text: &str) -> Result<(), &'static str> {
    let bytes = text.as_bytes();
    let mut depth = 0_usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                // Skip the string; the syntax is valid, so it ends.
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'{' | b'[' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err("the object is nested too deeply (at most 100 levels)");
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i + 1 < bytes.len()
                    && matches!(bytes[i + 1], b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-')
                {
                    i += 1;
                }
                let number = &text[start..=i];
                if number.parse::<f64>().map_or(true, |n| !n.is_finite()) {
                    return Err("a number is out of range");
                }
            }
            _ => {}
        }
        i += 1;
    }
    Ok(())
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
    fn refuses_what_could_not_be_read_back() {
        let nested = |depth: usize| {
            format!(
                r#"{{"state":{}1{}}}"#,
                r#"{"a":"#.repeat(depth - 1) + "[",
                "]".to_owned() + &"}".repeat(depth - 1)
            )
        };
        let h: Holder = serde_json::from_str(&nested(MAX_DEPTH)).unwrap();
        assert!(
            serde_json::from_str::<Value>(&format!(r#"{{"a":[{{"b":{}}}]}}"#, h.state.as_str()))
                .is_ok()
        );
        assert!(serde_json::from_str::<Holder>(&nested(MAX_DEPTH + 1)).is_err());
        assert!(serde_json::from_str::<Holder>(&nested(5_000)).is_err());
        for bad in [r#"{"state":{"n":1e400}}"#, r#"{"state":{"n":[-1E+309]}}"#] {
            assert!(serde_json::from_str::<Holder>(bad).is_err(), "{bad}");
        }
        // Numbers and brackets inside strings are text; big integers and tiny floats are fine.
        let ok =
            r#"{"state":{"s":"1e400 [[[[ \" {","n":18446744073709551616,"f":1e-400,"x":-0.5e3}}"#;
        let h: Holder = serde_json::from_str(ok).unwrap();
        assert_eq!(h.state.to_map()["s"], "1e400 [[[[ \" {");
    }

    #[test]
    fn decodes_from_a_value_too() {
        let h: Holder = serde_json::from_value(json!({"state": {"k": "v"}})).unwrap();
        assert_eq!(h.state.to_map()["k"], "v");
    }
}
