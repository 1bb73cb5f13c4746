//! The request log: one line per request on stderr (time, method, path, status, prompt and
//! completion tokens, time to first token, duration), as text or as one JSON object per line.
//!
//! A middleware gives each request a [`RequestLog`]; the handlers note the tokens on it, and
//! the line is written when its last holder lets go of it, so a streamed reply is logged when
//! its stream ends (or its client goes away), not when its headers are sent.

use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use serde_json::json;

/// How requests are logged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// `2026-01-02T03:04:05.678Z POST /v1/chat/completions 200 prompt=12 completion=8 ttft=0.012s duration=0.250s`
    #[default]
    Text,
    /// One JSON object per line.
    Json,
    /// No request log.
    Off,
}

/// What one request amounted to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogFields {
    pub method: String,
    pub path: String,
    pub status: u16,
    pub prompt_tokens: Option<usize>,
    pub completion_tokens: Option<usize>,
    /// Seconds from arrival to the first generated token.
    pub ttft: Option<f64>,
    pub duration: f64,
}

/// A request's log line in the making; written to stderr when dropped.
pub struct RequestLog {
    format: LogFormat,
    start: Instant,
    /// Unix time of arrival, in milliseconds.
    at_ms: u128,
    fields: Mutex<LogFields>,
}

impl RequestLog {
    pub fn new(format: LogFormat, method: &str, path: &str) -> RequestLog {
        let fields = LogFields {
            method: method.to_string(),
            path: path.to_string(),
            ..LogFields::default()
        };
        RequestLog {
            format,
            start: Instant::now(),
            at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis()),
            fields: Mutex::new(fields),
        }
    }

    fn update(&self, f: impl FnOnce(&mut LogFields)) {
        if let Ok(mut fields) = self.fields.lock() {
            f(&mut fields);
        }
    }

    /// Notes the prompt's length.
    pub fn prompt(&self, tokens: usize) {
        self.update(|f| f.prompt_tokens = Some(tokens));
    }

    /// Notes the tokens generated so far and when the first of them came.
    pub fn generated(&self, tokens: usize, first: Option<Instant>) {
        let ttft = first.map(|t| t.saturating_duration_since(self.start).as_secs_f64());
        self.update(|f| {
            f.completion_tokens = Some(tokens);
            f.ttft = f.ttft.or(ttft);
        });
    }

    fn status(&self, status: u16) {
        self.update(|f| f.status = status);
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let duration = self.start.elapsed().as_secs_f64();
        self.update(|f| f.duration = duration);
        if let Ok(fields) = self.fields.lock() {
            if let Some(line) = format_line(self.format, self.at_ms, &fields) {
                eprintln!("{line}");
            }
        }
    }
}

/// The middleware: a [`RequestLog`] in the request's extensions, its status noted.
pub async fn log_request(
    State(format): State<LogFormat>,
    mut req: Request,
    next: Next,
) -> Response {
    let log = Arc::new(RequestLog::new(
        format,
        req.method().as_str(),
        req.uri().path(),
    ));
    req.extensions_mut().insert(log.clone());
    let resp = next.run(req).await;
    log.status(resp.status().as_u16());
    resp
}

/// The log line of `f` (arrived at `at_ms`, Unix milliseconds); `None` when logging is off.
pub fn format_line(format: LogFormat, at_ms: u128, f: &LogFields) -> Option<String> {
    let time = utc_time(at_ms);
    match format {
        LogFormat::Off => None,
        LogFormat::Json => Some(
            json!({"time": time, "method": f.method, "path": f.path, "status": f.status,
                "prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
                "ttft_s": f.ttft, "duration_s": f.duration})
            .to_string(),
        ),
        LogFormat::Text => {
            let count = |n: Option<usize>| n.map_or("-".to_string(), |n| n.to_string());
            let ttft = f.ttft.map_or("-".to_string(), |t| format!("{t:.3}s"));
            Some(format!(
                "{time} {} {} {} prompt={} completion={} ttft={ttft} duration={:.3}s",
                f.method,
                f.path,
                f.status,
                count(f.prompt_tokens),
                count(f.completion_tokens),
                f.duration
            ))
        }
    }
}

/// RFC 3339 UTC time of Unix milliseconds, e.g. `2026-01-02T03:04:05.678Z`.
fn utc_time(ms: u128) -> String {
    let secs = (ms / 1000) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_as_text_and_json() {
        let f = LogFields {
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            status: 200,
            prompt_tokens: Some(12),
            completion_tokens: Some(8),
            ttft: Some(0.0123),
            duration: 0.25,
        };
        let at = 1_767_323_045_678; // 2026-01-02T03:04:05.678Z
        let text = format_line(LogFormat::Text, at, &f).unwrap();
        assert_eq!(text, "2026-01-02T03:04:05.678Z POST /v1/chat/completions 200 prompt=12 completion=8 ttft=0.012s duration=0.250s");
        let line = format_line(LogFormat::Json, at, &f).unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["status"], 200);
        assert_eq!(v["completion_tokens"], 8);
        assert_eq!(v["time"], "2026-01-02T03:04:05.678Z");
        let bare = LogFields {
            status: 404,
            ..LogFields::default()
        };
        let text = format_line(LogFormat::Text, 0, &bare).unwrap();
        assert!(text.starts_with("1970-01-01T00:00:00.000Z"), "{text}");
        assert!(text.contains("prompt=- completion=- ttft=-"), "{text}");
        assert!(format_line(LogFormat::Off, 0, &f).is_none());
    }
}
