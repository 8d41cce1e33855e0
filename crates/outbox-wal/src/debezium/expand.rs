//! `table.expand.json.payload`: a payload's JSON text turned into the value Debezium's Outbox
//! Event Router and Kafka Connect's JSON converter write for it, byte for byte, within bounds.
//!
//! What Debezium does (`EventRouterDelegate`, `JsonSchemaData`, `JsonConverter`):
//!
//! 1. Only text that starts with `{` or `[` is parsed (Jackson's `readTree`, which ignores what
//!    follows the first value); anything else — a JSON string, number, `true`, `null`, text
//!    with leading blanks — stays the string it was, with a warning.
//! 2. A Kafka Connect schema is inferred: an object becomes a struct of its fields in order,
//!    leaving out fields whose value is `null` or an empty array; an array takes the schema of
//!    its first non-null element, its elements must all be of one JSON type (and numbers of one
//!    of int32, int64, float64), and the objects of an array get the union of their fields. A
//!    failure here leaves the payload a string, with a warning.
//! 3. The JSON is converted to that schema and written: every field of a struct is written, a
//!    missing one as `null` (so objects in an array get every field of the array's schema),
//!    numbers as Java prints them (`42.50` → `42.5`, `1.0E-4`), strings as Jackson escapes them.
//!    When this step fails after a schema was inferred — a top-level array (which is never a
//!    struct), an integer beyond 64 bits (a float64 schema for a `BigDecimal`), array elements
//!    whose fields differ in type — Debezium puts the unexpanded string under the inferred
//!    schema and its connector stops with a `DataException`.
//!
//! What the relay does differently, deliberately (docs/from-debezium.md lists it): where
//! Debezium stops (step 3), the payload is sent as the string, as in steps 1–2, with a warning;
//! the fields of an array's objects come in the order they first appear (Debezium's order there
//! follows a `HashSet` of schemas, which varies between runs); and it is bounded: text above
//! `relay.max_payload_bytes` is never parsed (the row is dead-lettered), at most
//! `max_payload_bytes / 32` values (at least 1,024) and 1,000 levels of nesting (Jackson's own
//! limit) are expanded (more is sent as the string), and an expanded value above
//! `max_payload_bytes` (the union of an array's fields can make it much larger than the text) is
//! not built further: the row is dead-lettered. Expanding one payload so holds at most about
//! six times `max_payload_bytes`.

use std::collections::HashMap;

use outbox_types::routing::push_json_string;

/// Jackson's `StreamReadConstraints` defaults, which Debezium's `ObjectMapper` keeps.
const MAX_DEPTH: usize = 1000;
const MAX_NUMBER_CHARS: usize = 1000;
const MAX_STRING_UNITS: usize = 20_000_000;
const MAX_NAME_UNITS: usize = 50_000;
/// Objects with more fields than this get a hash index for duplicate keys and lookups.
const INDEXED_FIELDS: usize = 16;

/// How far expanding may go, derived from `relay.max_payload_bytes`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// The largest text parsed and the largest value written.
    pub max_bytes: usize,
    /// The most JSON values parsed.
    pub max_values: usize,
}

impl Limits {
    /// The bounds for `max_payload_bytes`: that many bytes, `max_payload_bytes / 32` values
    /// (at least 1,024).
    pub fn for_max_payload_bytes(max_payload_bytes: u64) -> Self {
        let max_bytes = usize::try_from(max_payload_bytes).unwrap_or(usize::MAX);
        Limits {
            max_bytes,
            max_values: (max_bytes / 32).max(1024),
        }
    }
}

/// What expanding a payload gave.
#[derive(Debug, PartialEq)]
pub(crate) enum Expanded {
    /// The value Debezium writes.
    Json(String),
    /// Sent as the string holding the text, for this reason (logged as a warning).
    Text(String),
    /// The expanded value would be larger than `max_bytes`: the row is dead-lettered.
    TooLarge,
}

/// Expand `text` as `table.expand.json.payload` does (see the module docs).
pub(crate) fn expand(text: &str, limits: Limits) -> Expanded {
    if text.len() > limits.max_bytes {
        return Expanded::TooLarge;
    }
    match text.as_bytes().first() {
        Some(b'{') => {}
        Some(b'[') => {
            return Expanded::Text(
                "the payload is a JSON array: Debezium expands objects only (an array it can infer a schema for stops its connector)".to_owned(),
            );
        }
        _ => {
            return Expanded::Text(
                "the payload does not start with `{` or `[` (a JSON string, number, boolean or null is not expanded)".to_owned(),
            );
        }
    }
    let mut parser = Parser {
        bytes: text.as_bytes(),
        text,
        pos: 0,
        values: 0,
        max_values: limits.max_values,
    };
    let root = match parser.value(1) {
        Ok(root) => root,
        Err(why) => {
            return Expanded::Text(format!("the payload is not JSON Debezium reads: {why}"));
        }
    };
    let schema = match infer(&root) {
        Ok(Some(schema)) => schema,
        Ok(None) => return Expanded::Text("the payload has no schema".to_owned()),
        Err(why) => {
            return Expanded::Text(format!("Debezium infers no schema for the payload: {why}"));
        }
    };
    let mut out = Writer {
        out: String::with_capacity(text.len().min(limits.max_bytes)),
        max_bytes: limits.max_bytes,
    };
    match out.value(&root, &schema) {
        Ok(()) => Expanded::Json(out.out),
        Err(Stop::TooLarge) => Expanded::TooLarge,
        Err(Stop::Mismatch(why)) => Expanded::Text(format!(
            "the payload does not fit the schema Debezium infers for it ({why}; Debezium's connector stops here)"
        )),
    }
}

/// A parsed JSON value, numbers classified as Jackson's `readTree` does.
#[derive(Debug)]
enum Node {
    Null,
    Bool(bool),
    /// Fits a Java `int`.
    Int(i32),
    /// Fits a Java `long`, not an `int`.
    Long(i64),
    /// A number with a fraction or an exponent (a Java `double`).
    Double(f64),
    /// An integer beyond 64 bits (a `BigInteger`).
    BigInt,
    Str(String),
    Array(Vec<Node>),
    /// Fields in order of first appearance; a repeated name keeps its place and takes the
    /// later value (Jackson's `ObjectNode`).
    Object(Vec<(String, Node)>),
}

impl Node {
    /// The JSON type, as Jackson's `JsonNodeType` tells them apart.
    fn kind(&self) -> u8 {
        match self {
            Node::Null => 0,
            Node::Bool(_) => 1,
            Node::Int(_) | Node::Long(_) | Node::Double(_) | Node::BigInt => 2,
            Node::Str(_) => 3,
            Node::Array(_) => 4,
            Node::Object(_) => 5,
        }
    }
}

struct Parser<'a> {
    bytes: &'a [u8],
    text: &'a str,
    pos: usize,
    values: usize,
    max_values: usize,
}

impl Parser<'_> {
    fn blank(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    fn fail<T>(&self, what: &str) -> Result<T, String> {
        Err(format!("{what} at byte {}", self.pos))
    }

    fn value(&mut self, depth: usize) -> Result<Node, String> {
        self.values += 1;
        if self.values > self.max_values {
            return Err(format!(
                "more than {} values (the bound for relay.max_payload_bytes)",
                self.max_values
            ));
        }
        self.blank();
        match self.bytes.get(self.pos) {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => Ok(Node::Str(self.string(MAX_STRING_UNITS)?)),
            Some(b't') => self.literal("true", Node::Bool(true)),
            Some(b'f') => self.literal("false", Node::Bool(false)),
            Some(b'n') => self.literal("null", Node::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => self.fail("an unexpected character"),
            None => self.fail("the end of the text"),
        }
    }

    fn literal(&mut self, word: &str, node: Node) -> Result<Node, String> {
        if self.bytes[self.pos..].starts_with(word.as_bytes()) {
            self.pos += word.len();
            Ok(node)
        } else {
            self.fail("an unexpected word")
        }
    }

    fn nested(&self, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err(format!("more than {MAX_DEPTH} levels of nesting"));
        }
        Ok(())
    }

    fn array(&mut self, depth: usize) -> Result<Node, String> {
        self.nested(depth)?;
        self.pos += 1;
        let mut items = Vec::new();
        self.blank();
        if self.bytes.get(self.pos) == Some(&b']') {
            self.pos += 1;
            return Ok(Node::Array(items));
        }
        loop {
            items.push(self.value(depth + 1)?);
            self.blank();
            match self.bytes.get(self.pos) {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Node::Array(items));
                }
                _ => return self.fail("an array without `,` or `]`"),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Node, String> {
        self.nested(depth)?;
        self.pos += 1;
        let mut fields: Vec<(String, Node)> = Vec::new();
        let mut index: Option<HashMap<String, usize>> = None;
        self.blank();
        if self.bytes.get(self.pos) == Some(&b'}') {
            self.pos += 1;
            return Ok(Node::Object(fields));
        }
        loop {
            self.blank();
            if self.bytes.get(self.pos) != Some(&b'"') {
                return self.fail("a field name that is not a string");
            }
            let name = self.string(MAX_NAME_UNITS)?;
            self.blank();
            if self.bytes.get(self.pos) != Some(&b':') {
                return self.fail("a field without `:`");
            }
            self.pos += 1;
            let value = self.value(depth + 1)?;
            if fields.len() >= INDEXED_FIELDS && index.is_none() {
                index = Some(
                    fields
                        .iter()
                        .enumerate()
                        .map(|(i, (n, _))| (n.clone(), i))
                        .collect(),
                );
            }
            let seen = match &index {
                Some(index) => index.get(&name).copied(),
                None => fields.iter().position(|(n, _)| *n == name),
            };
            match seen {
                Some(i) => fields[i].1 = value,
                None => {
                    if let Some(index) = &mut index {
                        index.insert(name.clone(), fields.len());
                    }
                    fields.push((name, value));
                }
            }
            self.blank();
            match self.bytes.get(self.pos) {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(Node::Object(fields));
                }
                _ => return self.fail("an object without `,` or `}`"),
            }
        }
    }

    /// A string, escapes decoded; at most `max_units` UTF-16 code units (Jackson counts chars).
    fn string(&mut self, max_units: usize) -> Result<String, String> {
        self.pos += 1;
        let mut out = String::new();
        let mut units = 0usize;
        loop {
            let start = self.pos;
            while let Some(&b) = self.bytes.get(self.pos) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            let plain = &self.text[start..self.pos];
            units += plain.chars().map(char::len_utf16).sum::<usize>();
            out.push_str(plain);
            if units > max_units {
                return Err(format!("a string longer than {max_units} characters"));
            }
            match self.bytes.get(self.pos) {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let c = match self.bytes.get(self.pos) {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            self.pos += 1;
                            let high = self.hex4()?;
                            let c = if (0xD800..0xDC00).contains(&high) {
                                if !self.bytes[self.pos..].starts_with(b"\\u") {
                                    return self.fail("a lone surrogate escape");
                                }
                                self.pos += 2;
                                let low = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&low) {
                                    return self.fail("a lone surrogate escape");
                                }
                                char::from_u32(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))
                            } else {
                                char::from_u32(high)
                            };
                            self.pos -= 1;
                            match c {
                                Some(c) => c,
                                None => return self.fail("a lone surrogate escape"),
                            }
                        }
                        _ => return self.fail("an invalid escape"),
                    };
                    self.pos += 1;
                    units += c.len_utf16();
                    out.push(c);
                }
                Some(_) => return self.fail("a raw control character in a string"),
                None => return self.fail("a string that never ends"),
            }
        }
    }

    fn hex4(&mut self) -> Result<u32, String> {
        let digits = self
            .text
            .get(self.pos..self.pos + 4)
            .filter(|d| d.bytes().all(|b| b.is_ascii_hexdigit()));
        match digits.and_then(|d| u32::from_str_radix(d, 16).ok()) {
            Some(v) => {
                self.pos += 4;
                Ok(v)
            }
            None => self.fail("an invalid \\u escape"),
        }
    }

    /// A number token as Jackson reads it: `-`? int frac? exp?, no leading zeros; integers
    /// as `int`, `long` or `BigInteger` by size, anything with a fraction or exponent as a
    /// `double` (`Double.parseDouble`, so `1e400` is infinity).
    fn number(&mut self) -> Result<Node, String> {
        let start = self.pos;
        let digits = |p: &mut Self| {
            let s = p.pos;
            while p.bytes.get(p.pos).is_some_and(u8::is_ascii_digit) {
                p.pos += 1;
            }
            p.pos - s
        };
        if self.bytes.get(self.pos) == Some(&b'-') {
            self.pos += 1;
        }
        let int_start = self.pos;
        let int_digits = digits(self);
        if int_digits == 0 {
            return self.fail("a number without digits");
        }
        if int_digits > 1 && self.bytes[int_start] == b'0' {
            return self.fail("a number with a leading zero");
        }
        let mut float = false;
        if self.bytes.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            float = true;
            if digits(self) == 0 {
                return self.fail("a number without digits after `.`");
            }
        }
        if let Some(b'e' | b'E') = self.bytes.get(self.pos) {
            self.pos += 1;
            float = true;
            if let Some(b'+' | b'-') = self.bytes.get(self.pos) {
                self.pos += 1;
            }
            if digits(self) == 0 {
                return self.fail("a number without exponent digits");
            }
        }
        let token = &self.text[start..self.pos];
        if token.len() > MAX_NUMBER_CHARS {
            return Err(format!(
                "a number longer than {MAX_NUMBER_CHARS} characters"
            ));
        }
        if float {
            return match token.parse::<f64>() {
                Ok(x) => Ok(Node::Double(x)),
                Err(_) => self.fail("an invalid number"),
            };
        }
        Ok(match token.parse::<i64>() {
            Ok(n) => match i32::try_from(n) {
                Ok(small) => Node::Int(small),
                Err(_) => Node::Long(n),
            },
            Err(_) => Node::BigInt,
        })
    }
}

/// A Kafka Connect schema, as `JsonSchemaData` infers it (every one optional).
#[derive(Clone, Debug, PartialEq)]
enum Schema {
    Str,
    Bool,
    Int32,
    Int64,
    Float64,
    Array(Box<Schema>),
    Struct(Vec<(String, Schema)>),
}

/// `JsonSchemaData.toConnectSchema`: `None` for `null` and empty arrays (their fields are left
/// out of a struct); the error says why Debezium infers none.
fn infer(node: &Node) -> Result<Option<Schema>, String> {
    Ok(Some(match node {
        Node::Null => return Ok(None),
        Node::Bool(_) => Schema::Bool,
        Node::Int(_) => Schema::Int32,
        Node::Long(_) => Schema::Int64,
        Node::Double(_) | Node::BigInt => Schema::Float64,
        Node::Str(_) => Schema::Str,
        Node::Array(items) if items.is_empty() => return Ok(None),
        Node::Array(items) => Schema::Array(Box::new(element_schema(items)?)),
        Node::Object(fields) => {
            let mut out = Vec::with_capacity(fields.len());
            for (name, value) in fields {
                if let Some(schema) = infer(value)? {
                    out.push((name.clone(), schema));
                }
            }
            Schema::Struct(out)
        }
    }))
}

/// `toConnectSchemaWithCycles`: the schema of a non-empty array's elements.
fn element_schema(items: &[Node]) -> Result<Schema, String> {
    let sample = items
        .iter()
        .find(|n| !matches!(n, Node::Null))
        .unwrap_or(&Node::Null);
    let number = |n: &Node| match n {
        Node::Int(_) => 0,
        Node::Long(_) => 1,
        _ => 2,
    };
    for item in items.iter().filter(|n| !matches!(n, Node::Null)) {
        if item.kind() != sample.kind() {
            return Err("an array whose elements are of different JSON types".to_owned());
        }
        if sample.kind() == 2 && number(item) != number(sample) {
            return Err("an array of numbers of different types (int, long, double)".to_owned());
        }
    }
    if let Node::Object(_) = sample {
        // The union of the objects' fields, in order of first appearance; a field keeps the
        // schema it first had.
        let mut fields: Vec<(String, Schema)> = Vec::new();
        let mut seen: HashMap<String, ()> = HashMap::new();
        for item in items.iter().filter(|n| matches!(n, Node::Object(_))) {
            if let Some(Schema::Struct(item_fields)) = infer(item)? {
                for (name, schema) in item_fields {
                    if seen.insert(name.clone(), ()).is_none() {
                        fields.push((name, schema));
                    }
                }
            }
        }
        return Ok(Schema::Struct(fields));
    }
    infer(sample)?.ok_or_else(|| "an array with no element Debezium can give a schema".to_owned())
}

enum Stop {
    TooLarge,
    Mismatch(&'static str),
}

/// Writes a value under its schema as `JsonConverter` does, stopping at `max_bytes`.
struct Writer {
    out: String,
    max_bytes: usize,
}

impl Writer {
    fn push(&mut self, text: &str) -> Result<(), Stop> {
        if self.out.len() + text.len() > self.max_bytes {
            return Err(Stop::TooLarge);
        }
        self.out.push_str(text);
        Ok(())
    }

    fn string(&mut self, text: &str) -> Result<(), Stop> {
        // Checked on the raw length first, so a huge string is never escaped past the bound.
        if self.out.len() + text.len() + 2 > self.max_bytes {
            return Err(Stop::TooLarge);
        }
        push_json_string(&mut self.out, text);
        if self.out.len() > self.max_bytes {
            return Err(Stop::TooLarge);
        }
        Ok(())
    }

    fn value(&mut self, node: &Node, schema: &Schema) -> Result<(), Stop> {
        match (node, schema) {
            (Node::Null, _) => self.push("null"),
            (Node::Str(s), Schema::Str) => self.string(s),
            (Node::Bool(b), Schema::Bool) => self.push(if *b { "true" } else { "false" }),
            (Node::Int(n), Schema::Int32) => self.push(&n.to_string()),
            (Node::Long(n), Schema::Int64) => self.push(&n.to_string()),
            (Node::Double(x), Schema::Float64) => self.push(&super::java_double(*x)),
            (Node::BigInt, _) => Err(Stop::Mismatch("an integer beyond 64 bits")),
            (Node::Array(items), Schema::Array(element)) => {
                self.push("[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.push(",")?;
                    }
                    self.value(item, element)?;
                }
                self.push("]")
            }
            (Node::Object(fields), Schema::Struct(schema)) => self.object(fields, schema),
            _ => Err(Stop::Mismatch(
                "a value whose type differs from the one inferred for its place",
            )),
        }
    }

    /// Every field of the schema, in its order: the object's value, or `null`.
    fn object(
        &mut self,
        fields: &[(String, Node)],
        schema: &[(String, Schema)],
    ) -> Result<(), Stop> {
        let index: Option<HashMap<&str, &Node>> = (fields.len() > INDEXED_FIELDS)
            .then(|| fields.iter().map(|(n, v)| (n.as_str(), v)).collect());
        self.push("{")?;
        for (i, (name, field_schema)) in schema.iter().enumerate() {
            if i > 0 {
                self.push(",")?;
            }
            self.string(name)?;
            self.push(":")?;
            let value = match &index {
                Some(index) => index.get(name.as_str()).copied(),
                None => fields.iter().find(|(n, _)| n == name).map(|(_, v)| v),
            };
            match value {
                Some(v) => self.value(v, field_schema)?,
                None => self.push("null")?,
            }
        }
        self.push("}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> String {
        match expand(text, Limits::for_max_payload_bytes(1 << 20)) {
            Expanded::Json(out) => out,
            other => panic!("{text}: {other:?}"),
        }
    }

    fn text(text: &str) -> String {
        match expand(text, Limits::for_max_payload_bytes(1 << 20)) {
            Expanded::Text(why) => why,
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn objects_are_compact_ordered_without_null_or_empty_array_fields() {
        assert_eq!(
            json(r#"{"items": [{"qty": 2, "sku": "A-1"}], "amount": 42}"#),
            r#"{"items":[{"qty":2,"sku":"A-1"}],"amount":42}"#
        );
        // Null fields and empty arrays have no schema: left out at every level.
        assert_eq!(
            json(r#"{"b": 42.50, "a": null, "c": {"z": null, "e": []}, "s": "😀\u001f"}"#),
            r#"{"b":42.5,"c":{},"s":"\uD83D\uDE00\u001F"}"#
        );
        // A repeated name keeps its first place and takes the last value (Jackson).
        assert_eq!(json(r#"{"a": 1, "b": 2, "a": 3}"#), r#"{"a":3,"b":2}"#);
        // What follows the first value is ignored, as readTree does.
        assert_eq!(json(r#"{"a": 1} trailing"#), r#"{"a":1}"#);
    }

    #[test]
    fn numbers_are_written_as_java_does() {
        assert_eq!(
            json(r#"{"a": [0.0001, 12345678.5, 1e21, -0.5, 2.0, 1E2]}"#),
            r#"{"a":[1.0E-4,1.23456785E7,1.0E21,-0.5,2.0,100.0]}"#
        );
        assert_eq!(
            json(r#"{"i": -0, "l": 3000000000, "inf": 1e400}"#),
            r#"{"i":0,"l":3000000000,"inf":"Infinity"}"#
        );
    }

    #[test]
    fn objects_in_an_array_get_every_field_of_the_arrays_schema() {
        assert_eq!(
            json(r#"{"rows": [{"a": 1}, {"b": "x"}, null, {"a": 2, "c": null}]}"#),
            r#"{"rows":[{"a":1,"b":null},{"a":null,"b":"x"},null,{"a":2,"b":null}]}"#
        );
        // Nested objects of later elements follow the first one's schema.
        assert_eq!(
            json(r#"{"r": [{"o": {"x": 1}}, {"o": {"y": 2}}]}"#),
            r#"{"r":[{"o":{"x":1}},{"o":{"x":null}}]}"#
        );
    }

    #[test]
    fn what_debezium_does_not_expand_stays_text() {
        for payload in [r#""a string""#, "42", "true", "null", " {\"a\":1}", ""] {
            assert!(text(payload).contains("does not start with"), "{payload}");
        }
        assert!(text("[1, 2]").contains("array"));
        assert!(text(r#"{"a": [1, "x"]}"#).contains("different JSON types"));
        assert!(text(r#"{"a": [1, 3000000000]}"#).contains("different types"));
        assert!(text(r#"{"a": [null, null]}"#).contains("no element"));
        assert!(text(r#"{"a": [[], [1]]}"#).contains("no element"));
        assert!(text(r#"{"a": {"b": "#).contains("not JSON"));
        assert!(text(r#"{"a": 01}"#).contains("leading zero"));
        // Where Debezium's connector stops: sent as text here.
        assert!(text(r#"{"big": 123456789012345678901234567890}"#).contains("beyond 64 bits"));
        assert!(text(r#"{"r": [{"a": 1}, {"a": "x"}]}"#).contains("differs"));
        assert!(text(r#"{"r": [[1], ["x"]]}"#).contains("differs"));
        assert!(text(r#"{"s": "\ud800"}"#).contains("surrogate"));
    }

    #[test]
    fn expanding_is_bounded() {
        let limits = Limits::for_max_payload_bytes(64 * 1024);
        assert_eq!(limits.max_values, 2048);
        // Too many values: sent as text.
        let many = format!("{{\"a\":[{}1]}}", "1,".repeat(4096));
        assert!(
            matches!(expand(&many, limits), Expanded::Text(why) if why.contains("more than 2048 values"))
        );
        // Too deep: sent as text.
        let deep = format!("{}{}", "{\"a\":".repeat(1001), "1");
        assert!(
            matches!(expand(&deep, limits), Expanded::Text(why) if why.contains("1000 levels"))
        );
        // Text above the limit is never parsed.
        let big = format!("{{\"a\":\"{}\"}}", "x".repeat(64 * 1024));
        assert_eq!(expand(&big, limits), Expanded::TooLarge);
        // The union of fields makes 300 objects × 300 fields: larger than the limit.
        let wide: Vec<String> = (0..300).map(|i| format!("{{\"field{i:04}\":1}}")).collect();
        let wide = format!("{{\"rows\":[{}]}}", wide.join(","));
        assert!(wide.len() < 64 * 1024);
        assert_eq!(expand(&wide, limits), Expanded::TooLarge);
    }
}
