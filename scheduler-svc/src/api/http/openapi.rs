//! The OpenAPI 3.1 document of the JSON API, generated from [`super::ROUTES`] and the proto
//! descriptors (with their comments), so it cannot drift from what is served. Schemas follow the
//! proto3 JSON mapping: lowerCamelCase names, enums as their names, 64-bit integers as strings,
//! `google.protobuf.Timestamp` as an RFC 3339 string.

use std::collections::BTreeMap;

use prost_reflect::{FieldDescriptor, Kind, MessageDescriptor};
use serde_json::{Value, json};

use super::{ROUTES, Route, Surface, message};

/// The document served on `/openapi.json`.
pub fn document() -> Value {
    document_of(Surface::All)
}

/// The document of the routes one listener serves.
pub fn document_of(surface: Surface) -> Value {
    let mut schemas = BTreeMap::new();
    let mut paths = serde_json::Map::new();
    for route in ROUTES.iter().filter(|r| surface.serves(r)) {
        let openapi_path = route.path.to_owned();
        let entry = paths
            .entry(openapi_path)
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("path items are objects");
        entry.insert(route.method.to_lowercase(), operation(route, &mut schemas));
    }
    schemas.insert(
        "Error".to_owned(),
        json!({
            "type": "object",
            "description": "Every failed call: the gRPC code's name, the typed reason (decide on it, never on the message), a message naming what is wrong, and the reason's metadata.",
            "required": ["code", "reason", "message"],
            "properties": {
                "code": {"type": "string", "examples": ["NOT_FOUND", "INVALID_ARGUMENT"]},
                "reason": {"type": "string", "description": "A value name of antidote.api.v1.ErrorReason (errors.proto).", "examples": ["LIVE_LESSON_NOT_FOUND", "STAGE_OUT_OF_RANGE"]},
                "message": {"type": "string"},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        }),
    );
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Antidote API",
            "version": "v1",
            "description": "The antidote.api.v1 services as JSON over HTTP: the same methods, \
                validation and errors as the gRPC API. Watch a live lesson as server-sent events.",
        },
        "paths": paths,
        "components": {"schemas": schemas},
    })
}

fn operation(route: &Route, schemas: &mut BTreeMap<String, Value>) -> Value {
    let input = message(route.input);
    let output = message(route.output);
    let path_fields: Vec<&str> = route
        .path
        .split('/')
        .filter_map(|p| p.strip_prefix('{').and_then(|p| p.strip_suffix('}')))
        .collect();
    let mut parameters = Vec::new();
    for name in &path_fields {
        let field = input
            .get_field_by_name(name)
            .expect("ROUTES path fields exist (unit-tested)");
        parameters.push(json!({
            "name": name,
            "in": "path",
            "required": true,
            "description": comment_of_field(&field),
            "schema": field_schema(&field, schemas),
        }));
    }
    let (service, method) = route.rpc.split_once('.').unwrap_or(("", route.rpc));
    // Unique, as OpenAPI requires: two services have a ListLiveLessons.
    let mut op = json!({
        "operationId": route.rpc.replace('.', "_"),
        "tags": [service],
        "summary": comment_of_method(service, method),
        "responses": {
            "default": {
                "description": "An error",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            },
        },
    });
    let rest: Vec<FieldDescriptor> = input
        .fields()
        .filter(|f| !path_fields.contains(&f.name()))
        .collect();
    if route.body {
        let mut properties = serde_json::Map::new();
        for field in &rest {
            let mut schema = field_schema(field, schemas);
            describe(&mut schema, comment_of_field(field));
            properties.insert(field.json_name().to_owned(), schema);
        }
        op["requestBody"] = json!({
            "required": false,
            "content": {"application/json": {"schema": {"type": "object", "properties": properties, "additionalProperties": false}}},
        });
    } else {
        for field in &rest {
            parameters.push(json!({
                "name": field.name(),
                "in": "query",
                "required": false,
                "description": comment_of_field(field),
                "schema": field_schema(field, schemas),
            }));
        }
    }
    op["parameters"] = Value::Array(parameters);
    let reference =
        json!({"$ref": format!("#/components/schemas/{}", add_message(&output, schemas))});
    op["responses"]["200"] = if route.stream {
        json!({
            "description": format!("Server-sent events: `event: live_lesson` with a {} as data on every change (the current state first); `event: error` with an Error, then the end. The stream ends when the live lesson is gone.", output.name()),
            "content": {"text/event-stream": {"schema": {"type": "string"}, "x-event-data": reference}},
        })
    } else {
        json!({
            "description": output.name(),
            "content": {"application/json": {"schema": reference}},
        })
    };
    op
}

/// Adds a message's schema (and those it uses) to `schemas`; returns its name there.
fn add_message(message: &MessageDescriptor, schemas: &mut BTreeMap<String, Value>) -> String {
    let name = message.name().to_owned();
    if schemas.contains_key(&name) {
        return name;
    }
    // Reserve the name first: messages may refer to themselves.
    schemas.insert(name.clone(), Value::Null);
    let mut properties = serde_json::Map::new();
    for field in message.fields() {
        let mut schema = field_schema(&field, schemas);
        describe(&mut schema, comment_of_field(&field));
        properties.insert(field.json_name().to_owned(), schema);
    }
    let mut schema = json!({"type": "object", "properties": properties});
    describe(&mut schema, comment(message.parent_file(), message.path()));
    schemas.insert(name.clone(), schema);
    name
}

fn describe(schema: &mut Value, description: String) {
    if !description.is_empty()
        && let Some(object) = schema.as_object_mut()
        && !object.contains_key("$ref")
    {
        object.insert("description".into(), Value::String(description));
    }
}

fn field_schema(field: &FieldDescriptor, schemas: &mut BTreeMap<String, Value>) -> Value {
    if field.is_map() {
        let Kind::Message(entry) = field.kind() else {
            return json!({"type": "object"});
        };
        return json!({
            "type": "object",
            "additionalProperties": field_schema(&entry.map_entry_value_field(), schemas),
        });
    }
    let single = kind_schema(field.kind(), schemas);
    if field.is_list() {
        json!({"type": "array", "items": single})
    } else {
        single
    }
}

fn kind_schema(kind: Kind, schemas: &mut BTreeMap<String, Value>) -> Value {
    match kind {
        Kind::Bool => json!({"type": "boolean"}),
        Kind::String => json!({"type": "string"}),
        Kind::Bytes => json!({"type": "string", "contentEncoding": "base64"}),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
            json!({"type": "integer", "format": "int32"})
        }
        Kind::Uint32 | Kind::Fixed32 => json!({"type": "integer", "format": "int64", "minimum": 0}),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => json!({"type": "string", "format": "int64"}),
        Kind::Uint64 | Kind::Fixed64 => json!({"type": "string", "format": "uint64"}),
        Kind::Float | Kind::Double => json!({"type": "number"}),
        Kind::Enum(e) => json!({
            "type": "string",
            "enum": e.values().map(|v| v.name().to_owned()).collect::<Vec<_>>(),
        }),
        Kind::Message(m) => match m.full_name() {
            "google.protobuf.Timestamp" => json!({"type": "string", "format": "date-time"}),
            "google.protobuf.Duration" => json!({"type": "string", "examples": ["1.5s"]}),
            _ => json!({"$ref": format!("#/components/schemas/{}", add_message(&m, schemas))}),
        },
    }
}

fn comment_of_field(field: &FieldDescriptor) -> String {
    comment(field.parent_file(), field.path())
}

fn comment_of_method(service: &str, method: &str) -> String {
    let Some(service) = super::POOL.get_service_by_name(&format!("antidote.api.v1.{service}"))
    else {
        return String::new();
    };
    service
        .methods()
        .find(|m| m.name() == method)
        .map(|m| comment(m.parent_file(), m.path()))
        .unwrap_or_default()
}

/// The leading comment of the element at `path` in `file`, as one line.
fn comment(file: prost_reflect::FileDescriptor, path: &[i32]) -> String {
    file.file_descriptor_proto()
        .source_code_info
        .as_ref()
        .and_then(|info| info.location.iter().find(|l| l.path == path))
        .and_then(|l| l.leading_comments.as_deref())
        .map(|c| c.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_covers_every_route_with_resolvable_schemas() {
        let doc = document();
        assert_eq!(doc["openapi"], "3.1.0");
        for route in ROUTES {
            let op = &doc["paths"][route.path][route.method.to_lowercase()];
            assert!(op.is_object(), "{} {} missing", route.method, route.path);
            let text = op.to_string();
            for reference in text.split("#/components/schemas/").skip(1) {
                let name = reference.split('"').next().unwrap();
                assert!(
                    doc["components"]["schemas"][name].is_object(),
                    "{name} is referenced but not defined"
                );
            }
        }
        let mut ids = std::collections::HashSet::new();
        for route in ROUTES {
            let id = doc["paths"][route.path][route.method.to_lowercase()]["operationId"].clone();
            assert!(ids.insert(id.to_string()), "operationId {id} is used twice");
        }
        let lesson = &doc["components"]["schemas"]["LiveLesson"];
        assert_eq!(lesson["properties"]["createdAt"]["format"], "date-time");
        assert_eq!(lesson["properties"]["generation"]["type"], "string");
        assert!(
            lesson["properties"]["status"]["enum"]
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v == "LIVE_LESSON_STATUS_READY")
        );
        let request = &doc["paths"]["/v1/live-lessons"]["post"];
        assert!(
            request["summary"].as_str().unwrap().len() > 10,
            "summaries come from the .proto comments: {request}"
        );
    }
}
