//! `multipart/related` bodies as DICOMweb frames them (PS3.18 8.6.1.2, RFC 2387 / RFC 2046 5.1):
//! a STOW-RS request carries one `application/dicom` part per instance, a WADO-RS response one
//! part per instance retrieved.
//!
//! [`parse_related`] takes the body and the `Content-Type` header it came with (the boundary is
//! that header's `boundary` parameter, quoted or not). It accepts what RFC 2046 allows: a preamble
//! before the first boundary, transport padding after a boundary, an epilogue after the closing
//! one, and (leniently) bare LF line ends besides CRLF. Outside data never makes it panic; a
//! missing boundary, a truncated body, a part over the size limit or a malformed part header is
//! a [`MultipartError`] that says what to check. [`build_related`] writes a body with CRLF line
//! ends; [`new_boundary`] picks a boundary that occurs in none of the parts.

use sha2::{Digest, Sha256};

use crate::error::PacsError;

/// The media type of a DICOM instance in a part (PS3.18 8.7.3.5).
pub const APPLICATION_DICOM: &str = "application/dicom";

/// Longest part header block accepted (headers are a few short lines in practice).
const MAX_HEADER_BYTES: usize = 16 * 1024;

/// Longest boundary accepted when parsing. RFC 2046 allows 70 characters; some servers (Orthanc
/// 1.10) send longer ones, so parsing is lenient while [`build_related`] keeps to 70.
const MAX_PARSE_BOUNDARY: usize = 200;

/// One body part: its media type (the part's `Content-Type`, or the multipart's `type`
/// parameter when the part has none) and its content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// The part's media type, e.g. `application/dicom`.
    pub content_type: String,
    /// The part's content, headers excluded.
    pub bytes: Vec<u8>,
}

impl Part {
    /// A part holding one DICOM Part 10 instance.
    pub fn dicom(bytes: Vec<u8>) -> Self {
        Self {
            content_type: APPLICATION_DICOM.to_string(),
            bytes,
        }
    }
}

/// Why a multipart body could not be parsed or built. Parts are numbered from 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MultipartError {
    /// The Content-Type is not a multipart type.
    #[error(
        "the Content-Type {content_type:?} is not multipart: a DICOMweb body of instances is \
         multipart/related; type=\"application/dicom\"; boundary=..."
    )]
    NotMultipart {
        /// The Content-Type given.
        content_type: String,
    },

    /// The Content-Type has no `boundary` parameter.
    #[error(
        "the Content-Type {content_type:?} has no boundary parameter: a multipart body needs \
         one (multipart/related; type=\"application/dicom\"; boundary=...)"
    )]
    MissingBoundary {
        /// The Content-Type given.
        content_type: String,
    },

    /// The boundary is empty, too long or has characters RFC 2046 forbids.
    #[error("invalid multipart boundary: {reason}")]
    InvalidBoundary {
        /// What is wrong with it.
        reason: String,
    },

    /// No line of the body holds the boundary.
    #[error(
        "the body has no line with the boundary given in its Content-Type: the boundary does \
         not match the body, or the body is not multipart"
    )]
    NoFirstBoundary,

    /// The body ends before the closing boundary.
    #[error(
        "the body ends inside part {part} ({reason}): the transfer was cut off; retry it, and \
         check the size limits of the sender and any proxy between"
    )]
    Truncated {
        /// The part being read when the body ended.
        part: usize,
        /// What was missing.
        reason: &'static str,
    },

    /// A part is larger than the caller's limit.
    #[error(
        "part {part} is over the limit of {limit} bytes: raise the limit, or send fewer or \
         smaller objects per request"
    )]
    PartTooLarge {
        /// The part over the limit.
        part: usize,
        /// The limit in bytes.
        limit: usize,
    },

    /// A part's header block cannot be parsed.
    #[error("part {part} has malformed headers: {reason}")]
    MalformedHeaders {
        /// The part whose headers are malformed.
        part: usize,
        /// What is wrong with them.
        reason: String,
    },

    /// A boundary line is followed by something other than a line end or `--`.
    #[error("the boundary line after part {part} is malformed: {reason}")]
    MalformedDelimiter {
        /// The part before the boundary line.
        part: usize,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// When building: a part's content contains the boundary.
    #[error(
        "the boundary occurs inside part {part}: pick another one (multipart::new_boundary does)"
    )]
    BoundaryInPart {
        /// The part that contains it.
        part: usize,
    },
}

impl From<MultipartError> for PacsError {
    fn from(e: MultipartError) -> Self {
        PacsError::Multipart(e)
    }
}

/// A media type with its parameters: the type/subtype lower-cased, parameter names lower-cased,
/// values unquoted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MediaType {
    /// `type/subtype`, lower-cased.
    pub essence: String,
    /// Parameters in order as (lower-cased name, unquoted value).
    pub params: Vec<(String, String)>,
}

impl MediaType {
    /// Parses a `Content-Type` value; `None` when it has no `type/subtype`.
    pub fn parse(value: &str) -> Option<Self> {
        let mut rest = value;
        let essence_end = rest.find(';').unwrap_or(rest.len());
        let essence = rest[..essence_end].trim().to_ascii_lowercase();
        let (ty, sub) = essence.split_once('/')?;
        if ty.is_empty() || sub.is_empty() || essence.contains(char::is_whitespace) {
            return None;
        }
        rest = &rest[essence_end..];
        let mut params = Vec::new();
        while let Some(after) = rest.strip_prefix(';') {
            let after = after.trim_start();
            let eq = match after.find(['=', ';']) {
                Some(i) if after.as_bytes()[i] == b'=' => i,
                // A parameter without a value: skip it.
                Some(i) => {
                    rest = &after[i..];
                    continue;
                }
                None => break,
            };
            let name = after[..eq].trim().to_ascii_lowercase();
            let value_part = after[eq + 1..].trim_start();
            let (val, remaining) = if let Some(q) = value_part.strip_prefix('"') {
                // Quoted string with backslash escapes (RFC 9110 5.6.4).
                let mut out = String::new();
                let mut chars = q.char_indices();
                let mut end = None;
                while let Some((i, c)) = chars.next() {
                    match c {
                        '\\' => {
                            if let Some((_, n)) = chars.next() {
                                out.push(n);
                            }
                        }
                        '"' => {
                            end = Some(i + 1);
                            break;
                        }
                        c => out.push(c),
                    }
                }
                // An unterminated quote takes the rest of the header.
                let end = end.unwrap_or(q.len());
                let after_q = &q[end..];
                let next = after_q.find(';').unwrap_or(after_q.len());
                (out, &after_q[next..])
            } else {
                let next = value_part.find(';').unwrap_or(value_part.len());
                (value_part[..next].trim().to_string(), &value_part[next..])
            };
            if !name.is_empty() {
                params.push((name, val));
            }
            rest = remaining;
        }
        Some(Self { essence, params })
    }

    /// A parameter's value (name compared case-insensitively).
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A header value cut for an error message: outside data stays short in messages and logs.
fn clip(s: &str) -> String {
    if s.len() <= 200 {
        return s.to_string();
    }
    let mut end = 200;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    let first = needle[0];
    let last_start = haystack.len() - needle.len();
    let mut i = 0;
    while i <= last_start {
        match haystack[i..=last_start].iter().position(|&b| b == first) {
            None => return None,
            Some(p) => {
                let at = i + p;
                if &haystack[at..at + needle.len()] == needle {
                    return Some(at);
                }
                i = at + 1;
            }
        }
    }
    None
}

/// Skips RFC 2046 transport padding (spaces and tabs) and one line end (CRLF or LF) at `pos`;
/// `Ok(None)` when the body ends first.
fn skip_padding_and_eol(body: &[u8], mut pos: usize) -> Result<Option<usize>, &'static str> {
    while pos < body.len() && (body[pos] == b' ' || body[pos] == b'\t') {
        pos += 1;
    }
    match body.get(pos..) {
        Some([b'\r', b'\n', ..]) => Ok(Some(pos + 2)),
        Some([b'\n', ..]) => Ok(Some(pos + 1)),
        Some([]) | Some([b'\r']) | None => Ok(None),
        Some(_) => Err("the boundary is followed by other text on its line"),
    }
}

/// Parses a `multipart/related` (or any `multipart/*`) body. `content_type` is the body's
/// `Content-Type` header; parts larger than `max_part_bytes` are refused. Parts without a
/// Content-Type get the multipart's `type` parameter (`application/dicom` for DICOMweb), else
/// `application/octet-stream`. A body whose closing boundary is missing is [`Truncated`]: no
/// part of it is returned.
///
/// [`Truncated`]: MultipartError::Truncated
pub fn parse_related(
    content_type: &str,
    body: &[u8],
    max_part_bytes: usize,
) -> Result<Vec<Part>, PacsError> {
    Ok(parse(content_type, body, max_part_bytes)?)
}

fn parse(
    content_type: &str,
    body: &[u8],
    max_part_bytes: usize,
) -> Result<Vec<Part>, MultipartError> {
    let media = MediaType::parse(content_type).ok_or_else(|| MultipartError::NotMultipart {
        content_type: clip(content_type),
    })?;
    if !media.essence.starts_with("multipart/") {
        return Err(MultipartError::NotMultipart {
            content_type: clip(content_type),
        });
    }
    let boundary = media
        .param("boundary")
        .ok_or_else(|| MultipartError::MissingBoundary {
            content_type: clip(content_type),
        })?;
    if boundary.is_empty() || boundary.len() > MAX_PARSE_BOUNDARY {
        return Err(MultipartError::InvalidBoundary {
            reason: format!(
                "it has {} characters; 1 to {MAX_PARSE_BOUNDARY} are accepted",
                boundary.len()
            ),
        });
    }
    let default_type = media
        .param("type")
        .filter(|t| !t.is_empty())
        .unwrap_or("application/octet-stream")
        .to_string();

    let dash_boundary = [b"--", boundary.as_bytes()].concat();
    // Every boundary after the first starts on a new line: "\n--boundary" (the "\r" before the
    // "\n", when there, belongs to the delimiter, not to the part).
    let delimiter = [b"\n--", boundary.as_bytes()].concat();

    // The first boundary: at the very start, or after a preamble line.
    let first = if body.starts_with(&dash_boundary) {
        0
    } else {
        find(body, &delimiter).ok_or(MultipartError::NoFirstBoundary)? + 1
    };
    let mut pos = first + dash_boundary.len();
    if body[pos..].starts_with(b"--") {
        // A body with no parts at all.
        return Ok(Vec::new());
    }
    let mut parts = Vec::new();
    loop {
        let part_no = parts.len() + 1;
        pos = match skip_padding_and_eol(body, pos) {
            Ok(Some(p)) => p,
            Ok(None) => {
                return Err(MultipartError::Truncated {
                    part: part_no,
                    reason: "after a boundary line",
                })
            }
            Err(reason) => {
                return Err(MultipartError::MalformedDelimiter {
                    part: part_no - 1,
                    reason,
                })
            }
        };

        // Headers, up to an empty line.
        let mut part_type = None;
        let mut header_bytes = 0usize;
        loop {
            let rest = &body[pos..];
            let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
                return Err(MultipartError::Truncated {
                    part: part_no,
                    reason: "in its headers",
                });
            };
            header_bytes += nl + 1;
            if header_bytes > MAX_HEADER_BYTES {
                return Err(MultipartError::MalformedHeaders {
                    part: part_no,
                    reason: format!("the headers are longer than {MAX_HEADER_BYTES} bytes"),
                });
            }
            let line = &rest[..nl];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            pos += nl + 1;
            if line.is_empty() {
                break;
            }
            let line = std::str::from_utf8(line).map_err(|_| MultipartError::MalformedHeaders {
                part: part_no,
                reason: "a header line is not UTF-8 text".into(),
            })?;
            let (name, value) =
                line.split_once(':')
                    .ok_or_else(|| MultipartError::MalformedHeaders {
                        part: part_no,
                        reason: format!("a header line has no colon: {:?}", clip(line)),
                    })?;
            if name.trim().eq_ignore_ascii_case("content-type") {
                part_type = Some(value.trim().to_string());
            }
        }

        // Content, up to the next delimiter; searching no further than the size limit allows.
        let window_end = body.len().min(
            pos.saturating_add(max_part_bytes)
                .saturating_add(delimiter.len() + 1),
        );
        let end = match find(&body[pos..window_end], &delimiter) {
            Some(i) => pos + i,
            None if window_end < body.len() => {
                return Err(MultipartError::PartTooLarge {
                    part: part_no,
                    limit: max_part_bytes,
                })
            }
            None => {
                return Err(MultipartError::Truncated {
                    part: part_no,
                    reason: "in its content, before the next boundary",
                })
            }
        };
        let content_end = if end > pos && body[end - 1] == b'\r' {
            end - 1
        } else {
            end
        };
        if content_end - pos > max_part_bytes {
            return Err(MultipartError::PartTooLarge {
                part: part_no,
                limit: max_part_bytes,
            });
        }
        parts.push(Part {
            content_type: part_type.unwrap_or_else(|| default_type.clone()),
            bytes: body[pos..content_end].to_vec(),
        });
        pos = end + delimiter.len();
        if body[pos..].starts_with(b"--") {
            // The closing boundary; what follows is the epilogue.
            return Ok(parts);
        }
        if body.len() - pos < 2 && body[pos..].iter().all(|&b| b == b'-') {
            return Err(MultipartError::Truncated {
                part: part_no,
                reason: "in the closing boundary",
            });
        }
    }
}

/// RFC 2046 `bcharsnospace` plus space (not last): what a boundary may hold.
fn valid_boundary(boundary: &str) -> Result<(), MultipartError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || "'()+_,-./:=? ".contains(c);
    if boundary.is_empty() || boundary.len() > 70 {
        return Err(MultipartError::InvalidBoundary {
            reason: format!("it has {} characters; 1 to 70 allowed", boundary.len()),
        });
    }
    if !boundary.chars().all(ok_char) || boundary.ends_with(' ') {
        return Err(MultipartError::InvalidBoundary {
            reason: "only letters, digits and '()+_,-./:=? are allowed (a space, not last)".into(),
        });
    }
    Ok(())
}

/// Writes a `multipart/related` body with CRLF line ends, each part with its Content-Type.
/// Returns the `Content-Type` to send with it (`type` = the first part's media type, the
/// boundary quoted when it needs to be) and the body. Refuses a boundary RFC 2046 does not
/// allow or one that occurs in a part.
pub fn build_related(parts: &[Part], boundary: &str) -> Result<(String, Vec<u8>), PacsError> {
    let parts: Vec<(&str, &[u8])> = parts
        .iter()
        .map(|p| (p.content_type.as_str(), p.bytes.as_slice()))
        .collect();
    build(&parts, boundary)
}

/// [`build_related`] for DICOM Part 10 objects (each an `application/dicom` part), without
/// copying them into [`Part`]s first: a STOW-RS request body.
pub fn build_related_dicom(
    objects: &[Vec<u8>],
    boundary: &str,
) -> Result<(String, Vec<u8>), PacsError> {
    let parts: Vec<(&str, &[u8])> = objects
        .iter()
        .map(|o| (APPLICATION_DICOM, o.as_slice()))
        .collect();
    build(&parts, boundary)
}

fn build(parts: &[(&str, &[u8])], boundary: &str) -> Result<(String, Vec<u8>), PacsError> {
    valid_boundary(boundary)?;
    let delimiter = [b"--", boundary.as_bytes()].concat();
    if let Some(i) = parts
        .iter()
        .position(|(_, bytes)| find(bytes, &delimiter).is_some())
    {
        return Err(MultipartError::BoundaryInPart { part: i + 1 }.into());
    }
    let media_type = |t: &'_ str| -> String {
        if t.is_empty() {
            APPLICATION_DICOM.to_string()
        } else {
            t.to_string()
        }
    };
    let root_type = media_type(parts.first().map(|(t, _)| *t).unwrap_or(""));
    let token = boundary
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "'+_-.".contains(c));
    let boundary_param = if token {
        boundary.to_string()
    } else {
        format!("\"{boundary}\"")
    };
    let content_type =
        format!("multipart/related; type=\"{root_type}\"; boundary={boundary_param}");
    let size: usize = parts.iter().map(|(_, b)| b.len() + 128).sum::<usize>() + 128;
    let mut body = Vec::with_capacity(size);
    for (ty, bytes) in parts {
        body.extend_from_slice(&delimiter);
        body.extend_from_slice(b"\r\nContent-Type: ");
        body.extend_from_slice(media_type(ty).as_bytes());
        body.extend_from_slice(b"\r\n\r\n");
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(&delimiter);
    body.extend_from_slice(b"--\r\n");
    Ok((content_type, body))
}

/// A boundary that occurs in none of `parts` ([`new_boundary_for`] takes bare contents).
pub fn new_boundary(parts: &[Part]) -> String {
    let contents: Vec<&[u8]> = parts.iter().map(|p| p.bytes.as_slice()).collect();
    new_boundary_for(&contents)
}

/// A boundary that occurs in none of `contents`: `hilum-` and 40 hex digits from the time, the
/// process and a counter.
pub fn new_boundary_for(contents: &[&[u8]]) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let mut h = Sha256::new();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        h.update(now.to_le_bytes());
        h.update(std::process::id().to_le_bytes());
        h.update(COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        let hex: String = h.finalize()[..20]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let boundary = format!("hilum-{hex}");
        let delimiter = format!("--{boundary}");
        if !contents
            .iter()
            .any(|c| find(c, delimiter.as_bytes()).is_some())
        {
            return boundary;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CT: &str = "multipart/related; type=\"application/dicom\"; boundary=XYZ";

    fn parse_ok(ct: &str, body: &[u8]) -> Vec<Part> {
        parse_related(ct, body, 1 << 20).unwrap_or_else(|e| panic!("{e}"))
    }

    fn err(ct: &str, body: &[u8], limit: usize) -> MultipartError {
        match parse(ct, body, limit) {
            Ok(parts) => panic!("parsed {} parts", parts.len()),
            Err(e) => e,
        }
    }

    fn sample_parts() -> Vec<Part> {
        vec![
            Part::dicom(b"DICM first\r\n--XY not the boundary\r\n".to_vec()),
            Part::dicom(Vec::new()),
            Part::dicom((0..=255u8).cycle().take(3000).collect()),
            Part {
                content_type: "application/dicom+json".into(),
                bytes: b"{}\r".to_vec(),
            },
        ]
    }

    #[test]
    fn round_trip_keeps_every_byte() {
        let parts = sample_parts();
        let (ct, body) = build_related(&parts, "XYZ").unwrap();
        assert_eq!(ct, CT);
        assert_eq!(parse_ok(&ct, &body), parts);
        let b = new_boundary(&parts);
        let (ct, body) = build_related(&parts, &b).unwrap();
        let dicom: Vec<Vec<u8>> = parts.iter().map(|p| p.bytes.clone()).collect();
        let (ct2, body2) = build_related_dicom(&dicom, &b).unwrap();
        let got = parse_ok(&ct2, &body2);
        assert_eq!(got.len(), parts.len());
        assert!(got
            .iter()
            .zip(&dicom)
            .all(|(p, d)| p.bytes == *d && p.content_type == APPLICATION_DICOM));
        assert!(ct.ends_with(&format!("boundary={b}")));
        assert_eq!(parse_ok(&ct, &body), parts);
    }

    #[test]
    fn boundary_quoted_or_not_and_parameters_in_any_order() {
        let body = b"--a b:c\r\nContent-Type: application/dicom\r\n\r\nxy\r\n--a b:c--\r\n";
        for ct in [
            "multipart/related; type=\"application/dicom\"; boundary=\"a b:c\"",
            "Multipart/Related;BOUNDARY=\"a b:c\";type=application/dicom",
            "multipart/related; boundary=\"a b\\:c\"; type=\"application/dicom\"",
        ] {
            let parts = parse_ok(ct, body);
            assert_eq!(parts, vec![Part::dicom(b"xy".to_vec())], "{ct}");
        }
        // A boundary that needs quotes is written quoted.
        let (ct, body) = build_related(&[Part::dicom(b"x".to_vec())], "a b:c").unwrap();
        assert!(ct.ends_with("boundary=\"a b:c\""), "{ct}");
        assert_eq!(parse_ok(&ct, &body)[0].bytes, b"x");
    }

    #[test]
    fn preamble_padding_epilogue_lf_and_default_type() {
        let body = b"preamble line\r\n--XYZ  \t\r\nContent-Length: 2\r\n\r\nab\r\n--XYZ\r\ncontent-type:  application/dicom \r\nX-Other: 1\r\n\r\ncd\r\n--XYZ--\r\nepilogue --XYZ junk";
        let parts = parse_ok(CT, body);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], Part::dicom(b"ab".to_vec()));
        assert_eq!(parts[1], Part::dicom(b"cd".to_vec()));
        // Bare LF line ends.
        let lf = b"--XYZ\nContent-Type: application/dicom\n\nab\n--XYZ\n\ncd\n--XYZ--";
        let parts = parse_ok(CT, lf);
        assert_eq!(parts[0].bytes, b"ab");
        assert_eq!(parts[1], Part::dicom(b"cd".to_vec()));
        // No type parameter and no part Content-Type: octet-stream.
        let parts = parse_ok(
            "multipart/related; boundary=XYZ",
            b"--XYZ\r\n\r\nq\r\n--XYZ--",
        );
        assert_eq!(parts[0].content_type, "application/octet-stream");
        // No parts at all.
        assert!(parse_ok(CT, b"--XYZ--\r\n").is_empty());
    }

    #[test]
    fn clear_errors() {
        assert!(matches!(
            err("application/dicom", b"", 10),
            MultipartError::NotMultipart { .. }
        ));
        assert!(matches!(
            err("", b"", 10),
            MultipartError::NotMultipart { .. }
        ));
        let e = err(
            "multipart/related; type=\"application/dicom\"",
            b"--x\r\n",
            10,
        );
        assert!(matches!(e, MultipartError::MissingBoundary { .. }));
        assert!(e.to_string().contains("no boundary parameter"), "{e}");
        assert!(matches!(
            err("multipart/related; boundary=\"\"", b"--", 10),
            MultipartError::InvalidBoundary { .. }
        ));
        assert_eq!(
            err(CT, b"--OTHER\r\n\r\nx\r\n--OTHER--", 10),
            MultipartError::NoFirstBoundary
        );
        assert_eq!(
            err(CT, b"--XYZ\r\n\r\n0123456789A\r\n--XYZ--", 10),
            MultipartError::PartTooLarge { part: 1, limit: 10 }
        );
        // Exactly at the limit is fine.
        assert_eq!(
            parse_related(CT, b"--XYZ\r\n\r\n0123456789\r\n--XYZ--", 10).unwrap()[0].bytes,
            b"0123456789"
        );
        // A huge part with no boundary after it is refused as too large without a full scan.
        let mut big = b"--XYZ\r\n\r\n".to_vec();
        big.resize(100_000, b'a');
        assert_eq!(
            err(CT, &big, 1000),
            MultipartError::PartTooLarge {
                part: 1,
                limit: 1000
            }
        );
        let e = err(CT, b"--XYZ\r\n\r\nabc", 100);
        assert!(
            matches!(e, MultipartError::Truncated { part: 1, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("cut off"), "{e}");
        assert!(matches!(
            err(CT, b"--XYZ junk\r\n\r\nabc\r\n--XYZ--", 100),
            MultipartError::MalformedDelimiter { .. }
        ));
        assert!(matches!(
            err(CT, b"--XYZ\r\nno colon here\r\n\r\nabc\r\n--XYZ--", 100),
            MultipartError::MalformedHeaders { part: 1, .. }
        ));
        let long_header = format!("--XYZ\r\nX: {}\r\n\r\n", "a".repeat(20_000));
        assert!(matches!(
            err(CT, long_header.as_bytes(), 100),
            MultipartError::MalformedHeaders { part: 1, .. }
        ));
        // The message keeps a hostile Content-Type short.
        let long_ct = format!("text/{}", "x".repeat(10_000));
        assert!(err(&long_ct, b"", 1).to_string().len() < 400);
    }

    #[test]
    fn build_refuses_bad_boundaries() {
        let parts = [Part::dicom(b"a\r\n--XYZ\r\nb".to_vec())];
        assert!(matches!(
            build_related(&parts, "XYZ"),
            Err(PacsError::Multipart(MultipartError::BoundaryInPart {
                part: 1
            }))
        ));
        for b in ["", "a\"b", "ends with space ", &"x".repeat(71), "é"] {
            assert!(
                matches!(
                    build_related(&[], b),
                    Err(PacsError::Multipart(MultipartError::InvalidBoundary { .. }))
                ),
                "{b:?}"
            );
        }
        let b = new_boundary(&parts);
        assert!(b.starts_with("hilum-") && b.len() == 46, "{b}");
        let (_, body) = build_related(&[], &b).unwrap();
        assert!(parse_ok(CT.replace("XYZ", &b).as_str(), &body).is_empty());
    }

    /// Every truncation of a valid body is an error or (when only the epilogue or the last
    /// line end went missing) the full parts; never a panic, never a part with wrong bytes.
    #[test]
    fn truncations_and_corruptions_never_panic() {
        let parts = sample_parts();
        let (ct, body) = build_related(&parts, "XYZ").unwrap();
        let full_close = body.len() - 2; // without the final CRLF (the epilogue)
        for cut in 0..body.len() {
            match parse(&ct, &body[..cut], 1 << 20) {
                Ok(got) => {
                    assert!(cut >= full_close, "cut at {cut} of {} parsed", body.len());
                    assert_eq!(got, parts);
                }
                Err(e) => {
                    assert!(cut < full_close, "cut at {cut}: {e}");
                    let _ = e.to_string();
                }
            }
        }
        // Byte flips and a small limit: any result, no panic; parts never exceed the limit.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for i in 0..3000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut b = body.clone();
            let at = (state as usize) % b.len();
            b[at] = match i % 4 {
                0 => b'\r',
                1 => b'\n',
                2 => b'-',
                _ => (state >> 32) as u8,
            };
            let cut = if i % 3 == 0 { at } else { b.len() };
            let limit = if i % 5 == 0 { 100 } else { 1 << 20 };
            if let Ok(got) = parse(&ct, &b[..cut], limit) {
                assert!(got.iter().all(|p| p.bytes.len() <= limit));
            }
        }
        for junk in [
            &b""[..],
            b"-",
            b"--",
            b"--XYZ",
            b"--XYZ-",
            b"\n--XYZ\r",
            b"--XYZ\r\n",
        ] {
            let _ = parse(CT, junk, 10);
        }
    }
}
