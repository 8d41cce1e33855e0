//! The HTTP API's error: one variant per answer a client can get, mapped to a status code and a
//! JSON body `{"error": "...", "field": "..."}`.
//!
//! Modelled on sqlx's `axum-social-with-tests` example: internal failures (database, outbox)
//! are logged with their cause and answered with a fixed "internal error" text, so a client
//! never sees SQL, table names or connection strings.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::order::RequestError;

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not a JSON object (400), or a field is missing, mistyped or out of range
    /// (422): [`RequestError`] says which, in the words the client gets.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The customer's open orders would exceed the credit limit (409). The order and its event
    /// were rolled back.
    #[error("credit limit exceeded: the customer's open orders would total {open} (limit {limit})")]
    CreditLimitExceeded {
        /// Open orders including this one, as a decimal amount.
        open: String,
        /// The limit, as a decimal amount.
        limit: String,
    },
    /// No order with that id (404).
    #[error("order not found")]
    NotFound,
    /// Anything on our side (500); the cause is logged, not returned.
    #[error("an internal error occurred")]
    Internal(#[from] crate::Error),
}

impl ApiError {
    /// The status code of this error.
    ///
    /// ```
    /// use outbox_orders::http::ApiError;
    /// use outbox_orders::order::RequestError;
    /// assert_eq!(ApiError::NotFound.status().as_u16(), 404);
    /// let malformed = ApiError::from(RequestError::Malformed("x".into()));
    /// assert_eq!(malformed.status().as_u16(), 400);
    /// ```
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Request(RequestError::Malformed(_)) => StatusCode::BAD_REQUEST,
            ApiError::Request(RequestError::Invalid { .. }) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::CreditLimitExceeded { .. } => StatusCode::CONFLICT,
            ApiError::NotFound => StatusCode::NOT_FOUND,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn field(&self) -> Option<&str> {
        match self {
            ApiError::Request(RequestError::Invalid { field, .. }) => Some(field),
            ApiError::CreditLimitExceeded { .. } => Some("amount"),
            _ => None,
        }
    }
}

/// The JSON body of every error answer.
#[derive(Serialize)]
struct ErrorBody<'a> {
    error: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Internal(cause) = &self {
            tracing::warn!(error = %cause, "Request failed on the server side; answered 500.");
        }
        let body = ErrorBody {
            error: self.to_string(),
            field: self.field(),
        };
        (self.status(), Json(body)).into_response()
    }
}
