//! DICOM reading (with or without Part 10 header) and decoding to the canonical image.

use std::panic::{catch_unwind, AssertUnwindSafe};

use dicom_core::dictionary::{UidDictionary, UidDictionaryEntry};
use dicom_core::Tag;
use dicom_dictionary_std::{tags, StandardSopClassDictionary};
use dicom_encoding::TransferSyntaxIndex;
use dicom_object::{FileDicomObject, FileMetaTableBuilder, InMemDicomObject};
use dicom_pixeldata::{ConvertOptions, ModalityLutOption, PixelDecoder};
use dicom_transfer_syntax_registry::TransferSyntaxRegistry;
use serde::{Deserialize, Serialize};

use crate::canonical::{check_size, CxrImage, DecodeOptions, ImageMeta, Voi};
use crate::ImagingError;

pub(crate) type DicomFile = FileDicomObject<InMemDicomObject>;

const IMPLICIT_VR_LE: &str = "1.2.840.10008.1.2";
const EXPLICIT_VR_LE: &str = "1.2.840.10008.1.2.1";
/// Secondary Capture, used only to complete a File Meta table the file did not have.
const SECONDARY_CAPTURE: &str = "1.2.840.10008.5.1.4.1.1.7";

/// Non-PHI facts about a DICOM object: what `dicom_info` shows and decode uses.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DicomSummary {
    /// SOP Class UID.
    pub sop_class: Option<String>,
    /// Its name (`Digital X-Ray Image Storage - For Presentation`, …).
    pub sop_class_name: Option<String>,
    /// Modality (`CR`, `DX`, …).
    pub modality: Option<String>,
    /// Body Part Examined.
    pub body_part: Option<String>,
    /// View Position (`PA`, `AP`, `LL`, …).
    pub view_position: Option<String>,
    /// Image Laterality, else Laterality.
    pub laterality: Option<String>,
    /// Patient Orientation (the directions of the rows and columns).
    pub patient_orientation: Option<String>,
    /// Manufacturer of the equipment.
    pub manufacturer: Option<String>,
    /// Rows.
    pub rows: u32,
    /// Columns.
    pub columns: u32,
    /// Number of Frames (1 when absent).
    pub frames: u32,
    /// Samples per Pixel.
    pub samples_per_pixel: u16,
    /// Bits Allocated.
    pub bits_allocated: u16,
    /// Bits Stored.
    pub bits_stored: u16,
    /// Pixel Representation is signed.
    pub signed: bool,
    /// Photometric Interpretation.
    pub photometric: Option<String>,
    /// Transfer Syntax UID.
    pub transfer_syntax: String,
    /// Its name.
    pub transfer_syntax_name: String,
    /// (row, column) in mm: Pixel Spacing, else Imager Pixel Spacing; zeros count as unknown.
    pub pixel_spacing_mm: Option<(f64, f64)>,
    /// (slope, intercept) of the modality rescale; (1, 0) when absent.
    pub rescale: (f64, f64),
    /// Every (centre, width) pair the file recommends.
    pub windows: Vec<(f64, f64)>,
    /// VOI LUT Function (`LINEAR`, `LINEAR_EXACT`, `SIGMOID`).
    pub voi_lut_function: Option<String>,
    /// The file carries a VOI LUT Sequence.
    pub has_voi_lut_table: bool,
    /// The file carries Pixel Data.
    pub has_pixel_data: bool,
    /// Burned In Annotation (`YES`: the pixels may show identifying text).
    pub burned_in_annotation: Option<String>,
    /// Patient Identity Removed, as the file says.
    pub patient_identity_removed: Option<String>,
    /// Names (never values) of identifying attributes present in the source.
    pub phi_attributes_present: Vec<String>,
    /// Things a careful reader should know (no File Meta, …).
    pub warnings: Vec<String>,
}

/// True when the bytes are a DICOM file: Part 10 (with or without preamble) or a bare
/// little-endian dataset starting at a group 0x0002/0x0008 element.
pub(crate) fn looks_like_dicom(bytes: &[u8]) -> bool {
    if bytes.len() >= 132 && &bytes[128..132] == b"DICM" {
        return true;
    }
    if bytes.starts_with(b"DICM") {
        return true;
    }
    bare_dataset_ts(bytes).is_some()
}

/// The transfer syntax of a dataset with no File Meta, guessed from its first element header.
fn bare_dataset_ts(bytes: &[u8]) -> Option<&'static str> {
    if bytes.len() < 8 {
        return None;
    }
    let group = u16::from_le_bytes([bytes[0], bytes[1]]);
    let element = u16::from_le_bytes([bytes[2], bytes[3]]);
    if !(group == 0x0002 || group == 0x0008) || element > 0x00FF {
        return None;
    }
    if bytes[4].is_ascii_uppercase() && bytes[5].is_ascii_uppercase() {
        return Some(EXPLICIT_VR_LE);
    }
    let len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    (len as usize <= bytes.len()).then_some(IMPLICIT_VR_LE)
}

/// Parses a DICOM file. A dataset without preamble / File Meta is read as implicit (or
/// explicit) VR little endian with a warning, as many archives still hold such files.
pub(crate) fn parse(bytes: &[u8], what: &str) -> Result<(DicomFile, Vec<String>), ImagingError> {
    let err = |reason: String| ImagingError::Decode {
        what: what.to_string(),
        reason,
    };
    check_lengths(bytes, what)?;
    let part10 = (bytes.len() >= 132 && &bytes[128..132] == b"DICM") || bytes.starts_with(b"DICM");
    let guarded = catch_unwind(AssertUnwindSafe(|| {
        if part10 {
            return dicom_object::from_reader(bytes)
                .map(|o| (o, Vec::new()))
                .map_err(|e| err(format!("invalid DICOM file: {e}")));
        }
        let ts_uid = bare_dataset_ts(bytes).ok_or_else(|| err("not a DICOM file".into()))?;
        let ts = TransferSyntaxRegistry
            .get(ts_uid)
            .ok_or_else(|| err(format!("transfer syntax {ts_uid} is not registered")))?;
        let obj = InMemDicomObject::read_dataset_with_ts(bytes, ts)
            .map_err(|e| err(format!("invalid DICOM dataset: {e}")))?;
        let meta = FileMetaTableBuilder::new()
            .transfer_syntax(ts_uid)
            .media_storage_sop_class_uid(SECONDARY_CAPTURE)
            .media_storage_sop_instance_uid("2.25.0");
        let obj = obj
            .with_meta(meta)
            .map_err(|e| err(format!("cannot complete the missing File Meta: {e}")))?;
        let warning = format!(
            "no DICOM preamble / File Meta: read as a bare {} dataset",
            if ts_uid == IMPLICIT_VR_LE {
                "implicit VR little endian"
            } else {
                "explicit VR little endian"
            }
        );
        // Not `what`: a file's name may name the patient.
        tracing::warn!("{warning}");
        Ok((obj, vec![warning]))
    }));
    guarded.unwrap_or_else(|_| Err(err("malformed DICOM structure".into())))
}

fn text(obj: &DicomFile, tag: Tag) -> Option<String> {
    let s = obj.get(tag)?.to_str().ok()?;
    let s = s.trim_matches(|c: char| c.is_whitespace() || c == '\0');
    (!s.is_empty()).then(|| s.to_string())
}

fn floats(obj: &DicomFile, tag: Tag) -> Vec<f64> {
    obj.get(tag)
        .and_then(|e| e.to_multi_float64().ok())
        .unwrap_or_default()
}

fn uint(obj: &DicomFile, tag: Tag) -> Option<u32> {
    obj.get(tag).and_then(|e| e.to_int::<u32>().ok())
}

/// Identifying attributes the de-identification profile acts on (for the summary only).
pub(crate) const PHI_NAMES: &[(Tag, &str)] = &[
    (tags::PATIENT_NAME, "PatientName"),
    (tags::PATIENT_ID, "PatientID"),
    (tags::PATIENT_BIRTH_DATE, "PatientBirthDate"),
    (tags::PATIENT_ADDRESS, "PatientAddress"),
    (Tag(0x0010, 0x1000), "OtherPatientIDs"),
    (tags::INSTITUTION_NAME, "InstitutionName"),
    (tags::REFERRING_PHYSICIAN_NAME, "ReferringPhysicianName"),
    (tags::PERFORMING_PHYSICIAN_NAME, "PerformingPhysicianName"),
    (tags::OPERATORS_NAME, "OperatorsName"),
    (tags::ACCESSION_NUMBER, "AccessionNumber"),
    (tags::STUDY_DATE, "StudyDate"),
];

fn summarise(obj: &DicomFile, warnings: Vec<String>) -> DicomSummary {
    let ts_uid = obj
        .meta()
        .transfer_syntax()
        .trim_end_matches('\0')
        .to_string();
    let ts_name = TransferSyntaxRegistry
        .get(&ts_uid)
        .map(|t| t.name().to_string())
        .unwrap_or_else(|| "unknown".into());
    let sop_class = text(obj, tags::SOP_CLASS_UID);
    let sop_class_name = sop_class
        .as_deref()
        .and_then(|u| StandardSopClassDictionary.by_uid(u))
        .map(|e| e.name().to_string());
    let spacing = |tag| {
        let v = floats(obj, tag);
        (v.len() >= 2 && v[0] > 0.0 && v[1] > 0.0).then(|| (v[0], v[1]))
    };
    let centers = floats(obj, tags::WINDOW_CENTER);
    let widths = floats(obj, tags::WINDOW_WIDTH);
    let windows = centers
        .iter()
        .zip(widths.iter())
        .map(|(&c, &w)| (c, w))
        .collect();
    let slope = floats(obj, tags::RESCALE_SLOPE).first().copied();
    let intercept = floats(obj, tags::RESCALE_INTERCEPT).first().copied();
    let phi = PHI_NAMES
        .iter()
        .filter(|(t, _)| text(obj, *t).is_some())
        .map(|(_, n)| n.to_string())
        .collect();
    DicomSummary {
        sop_class,
        sop_class_name,
        modality: text(obj, tags::MODALITY),
        body_part: text(obj, tags::BODY_PART_EXAMINED),
        view_position: text(obj, tags::VIEW_POSITION),
        laterality: text(obj, tags::IMAGE_LATERALITY).or_else(|| text(obj, tags::LATERALITY)),
        patient_orientation: text(obj, tags::PATIENT_ORIENTATION),
        manufacturer: text(obj, tags::MANUFACTURER),
        rows: uint(obj, tags::ROWS).unwrap_or(0),
        columns: uint(obj, tags::COLUMNS).unwrap_or(0),
        frames: uint(obj, tags::NUMBER_OF_FRAMES).unwrap_or(1),
        samples_per_pixel: uint(obj, tags::SAMPLES_PER_PIXEL).unwrap_or(1) as u16,
        bits_allocated: uint(obj, tags::BITS_ALLOCATED).unwrap_or(0) as u16,
        bits_stored: uint(obj, tags::BITS_STORED)
            .or_else(|| uint(obj, tags::BITS_ALLOCATED))
            .unwrap_or(0) as u16,
        signed: uint(obj, tags::PIXEL_REPRESENTATION) == Some(1),
        photometric: text(obj, tags::PHOTOMETRIC_INTERPRETATION),
        transfer_syntax: ts_uid,
        transfer_syntax_name: ts_name,
        pixel_spacing_mm: spacing(tags::PIXEL_SPACING)
            .or_else(|| spacing(tags::IMAGER_PIXEL_SPACING)),
        rescale: (
            slope.filter(|s| *s != 0.0).unwrap_or(1.0),
            intercept.unwrap_or(0.0),
        ),
        windows,
        voi_lut_function: text(obj, tags::VOILUT_FUNCTION),
        has_voi_lut_table: obj.get(tags::VOILUT_SEQUENCE).is_some(),
        has_pixel_data: obj.get(tags::PIXEL_DATA).is_some(),
        burned_in_annotation: text(obj, tags::BURNED_IN_ANNOTATION),
        patient_identity_removed: text(obj, tags::PATIENT_IDENTITY_REMOVED),
        phi_attributes_present: phi,
        warnings,
    }
}

/// Reads a DICOM file's non-identifying attributes without decoding its pixels.
pub fn read_dicom(bytes: &[u8], what: &str) -> Result<DicomSummary, ImagingError> {
    if !looks_like_dicom(bytes) {
        return Err(ImagingError::NotDicom {
            what: what.to_string(),
        });
    }
    let (obj, warnings) = parse(bytes, what)?;
    Ok(summarise(&obj, warnings))
}

pub(crate) fn decode_dicom(
    bytes: &[u8],
    what: &str,
    opts: &DecodeOptions,
) -> Result<CxrImage, ImagingError> {
    let (obj, warnings) = parse(bytes, what)?;
    let s = summarise(&obj, warnings);
    decode_object(&obj, s, what, opts)
}

fn decode_object(
    obj: &DicomFile,
    mut s: DicomSummary,
    what: &str,
    opts: &DecodeOptions,
) -> Result<CxrImage, ImagingError> {
    let err = |reason: String| ImagingError::Decode {
        what: what.to_string(),
        reason,
    };
    if !s.has_pixel_data {
        let kind = s
            .modality
            .clone()
            .or_else(|| s.sop_class_name.clone())
            .unwrap_or_else(|| "non-image".into());
        return Err(ImagingError::NotAnImage {
            what: what.to_string(),
            kind,
        });
    }
    match TransferSyntaxRegistry.get(&s.transfer_syntax) {
        Some(ts) if ts.can_decode_all() => {}
        other => {
            return Err(ImagingError::UnsupportedTransferSyntax {
                what: what.to_string(),
                uid: s.transfer_syntax.clone(),
                name: other
                    .map(|t| t.name().to_string())
                    .unwrap_or_else(|| "unknown".into()),
            })
        }
    }
    // The pixel budget is checked on the header, before the codec allocates anything.
    check_size(
        what,
        s.columns as u64,
        s.rows as u64,
        s.samples_per_pixel.max(1) as u64,
        opts.max_pixels,
    )?;
    if !(1..=16).contains(&s.bits_stored) || !matches!(s.bits_allocated, 8 | 16) {
        return Err(err(format!(
            "{} bits stored in {} bits allocated is not a radiograph layout Hilum supports",
            s.bits_stored, s.bits_allocated
        )));
    }
    if !matches!(s.samples_per_pixel, 1 | 3) {
        return Err(err(format!(
            "{} samples per pixel is not supported",
            s.samples_per_pixel
        )));
    }
    if s.frames > 1 {
        s.warnings
            .push(format!("{} frames: only the first is used", s.frames));
    }
    if let Some(pixels) = obj.get(tags::PIXEL_DATA) {
        // Native pixel data must hold at least one whole frame; the codec would slice past it.
        if let Some(raw) = pixels.value().primitive().map(|p| p.to_bytes()) {
            {
                let need = s.rows as usize
                    * s.columns as usize
                    * s.samples_per_pixel as usize
                    * (s.bits_allocated as usize / 8);
                if raw.len() < need {
                    return Err(err(format!(
                        "pixel data is truncated: {} bytes, one frame needs {need}",
                        raw.len()
                    )));
                }
            }
        }
    }
    let options = ConvertOptions::new().with_modality_lut(ModalityLutOption::None);
    let stored: Vec<f32> = match libjpeg_turbo_frame(obj, &s, what, opts.max_pixels)? {
        Some(samples) => samples,
        None => dicom_rs_frame(obj, &s, what, &options)?,
    };

    let (w, h) = (s.columns, s.rows);
    let n = w as usize * h as usize;
    let spp = s.samples_per_pixel as usize;
    if stored.len() < n * spp {
        return Err(err(format!(
            "decoded {} samples, expected {} for {w}x{h}",
            stored.len(),
            n * spp
        )));
    }
    let photometric = s
        .photometric
        .clone()
        .unwrap_or_else(|| "MONOCHROME2".into());
    let monochrome1 = photometric == "MONOCHROME1";
    // What the VOI step did, as decided once below (colour images have none).
    let mut voi_lut_applied = false;
    let mut window_applied = None;
    let (bit_depth, max, mut pixels) = if spp == 3 {
        // Colour DICOM (secondary capture of a screen, …): luminance, 8 or 16 bits.
        let max = ((1u32 << s.bits_stored) - 1) as f32;
        let luma = stored
            .chunks_exact(3)
            .take(n)
            .map(|p| (0.299 * p[0] + 0.587 * p[1] + 0.114 * p[2]).clamp(0.0, max))
            .collect();
        (s.bits_stored as u8, max, luma)
    } else {
        let bits = s.bits_stored;
        let max = ((1u32 << bits) - 1) as f32;
        let min_stored = if s.signed {
            -((1u32 << (bits - 1)) as f32)
        } else {
            0.0
        };
        // The file's VOI LUT table wins over its windows when both are present (as pydicom's
        // `apply_voi_lut` does by default); a window given by the caller wins over both.
        let table = match opts.voi {
            Voi::FromFile if s.has_voi_lut_table => match voi_table(obj, s.signed) {
                Ok(t) => Some(t),
                Err(reason) => {
                    s.warnings.push(format!(
                        "the file's VOI LUT table is unusable ({reason}); its window is used instead"
                    ));
                    None
                }
            },
            _ => None,
        };
        let window = match opts.voi {
            Voi::None => None,
            Voi::Window { center, width } => Some((center, width)),
            Voi::FromFile if table.is_some() => None,
            Voi::FromFile => s.windows.first().copied(),
        };
        let window = window.filter(|&(_, w)| {
            let ok = w.is_finite() && w >= 1.0;
            if !ok {
                s.warnings
                    .push(format!("window width {w} is invalid: ignored"));
            }
            ok
        });
        let (slope, intercept) = s.rescale;
        let px: Vec<f32> = match (&table, window) {
            (Some(t), _) => stored[..n]
                .iter()
                .map(|&v| t.apply(v as f64 * slope + intercept, max))
                .collect(),
            (None, Some((c, wdt))) => {
                let f = VoiFn::parse(s.voi_lut_function.as_deref(), opts.voi);
                stored[..n]
                    .iter()
                    .map(|&v| f.apply(v as f64 * slope + intercept, c, wdt, max as f64) as f32)
                    .collect()
            }
            (None, None) => stored[..n]
                .iter()
                .map(|&v| (v - min_stored).clamp(0.0, max))
                .collect(),
        };
        voi_lut_applied = table.is_some();
        window_applied = window;
        (bits as u8, max, px)
    };
    if monochrome1 {
        for v in pixels.iter_mut() {
            *v = max - *v;
        }
    }
    Ok(CxrImage {
        width: w,
        height: h,
        pixels,
        meta: ImageMeta {
            format: "dicom".into(),
            width: w,
            height: h,
            bit_depth,
            source_channels: spp as u8,
            pixel_spacing_mm: s.pixel_spacing_mm,
            view_position: s.view_position.clone(),
            photometric: Some(photometric),
            modality: s.modality.clone(),
            body_part: s.body_part.clone(),
            transfer_syntax: Some((s.transfer_syntax.clone(), s.transfer_syntax_name.clone())),
            bits_allocated: Some(s.bits_allocated as u8),
            rescale: Some(s.rescale),
            file_window: s.windows.first().copied(),
            window_applied,
            voi_lut_applied,
            inverted: monochrome1,
            frames: Some(s.frames),
            warnings: s.warnings,
        },
    })
}

/// A VOI LUT table (PS3.3 C.11.2.1.1): the first item of the VOI LUT Sequence.
#[derive(Clone, Debug, PartialEq)]
struct VoiTable {
    /// The input value mapped to the first entry.
    first: i64,
    entries: Vec<u16>,
    /// Bits per entry (8..=16): outputs span `0..2^bits`.
    bits: u32,
}

impl VoiTable {
    /// Maps a rescaled value through the table (inputs outside it take the end entries) and
    /// scales the output to `0..=y_max`, the range every other VOI path produces.
    fn apply(&self, x: f64, y_max: f32) -> f32 {
        let last = self.entries.len() as i64 - 1;
        let i = ((x.round() as i64).saturating_sub(self.first)).clamp(0, last) as usize;
        let out_max = ((1u32 << self.bits) - 1) as f32;
        (self.entries[i] as f32).min(out_max) * y_max / out_max
    }
}

/// The first frame's stored values through dicom-rs's codecs.
fn dicom_rs_frame(
    obj: &DicomFile,
    s: &DicomSummary,
    what: &str,
    options: &ConvertOptions,
) -> Result<Vec<f32>, ImagingError> {
    let err = |reason: String| ImagingError::Decode {
        what: what.to_string(),
        reason,
    };
    catch_unwind(AssertUnwindSafe(|| {
        let px = obj.decode_pixel_data_frame(0).map_err(|e| {
            let msg = e.to_string();
            if msg.contains("Unsupported") {
                ImagingError::UnsupportedTransferSyntax {
                    what: what.to_string(),
                    uid: s.transfer_syntax.clone(),
                    name: s.transfer_syntax_name.clone(),
                }
            } else {
                err(format!("cannot decode the pixel data: {msg}"))
            }
        })?;
        px.to_vec_frame_with_options::<f32>(0, options)
            .map_err(|e| err(format!("cannot convert the pixel data: {e}")))
    }))
    .unwrap_or_else(|_| Err(err("the pixel data is malformed".into())))
}

/// JPEG Baseline and 8-bit Extended grayscale frames, decoded by libjpeg-turbo as pydicom
/// does with Pillow installed (its default for these transfer syntaxes): the same samples bit
/// for bit, where dicom-rs's `jpeg-decoder` is one level off on ~2% of the pixels.
/// `Ok(None)`: another layout (12-bit, colour, several fragments per frame of a multi-frame
/// object), left to dicom-rs.
fn libjpeg_turbo_frame(
    obj: &DicomFile,
    s: &DicomSummary,
    what: &str,
    max_pixels: u64,
) -> Result<Option<Vec<f32>>, ImagingError> {
    const JPEG_BASELINE: &str = "1.2.840.10008.1.2.4.50";
    const JPEG_EXTENDED: &str = "1.2.840.10008.1.2.4.51";
    let ts = s.transfer_syntax.trim_end_matches('\0');
    if !(ts == JPEG_BASELINE || ts == JPEG_EXTENDED)
        || s.samples_per_pixel != 1
        || s.bits_allocated != 8
        || s.bits_stored != 8
    {
        return Ok(None);
    }
    let Some(fragments) = obj
        .get(tags::PIXEL_DATA)
        .and_then(|e| e.value().fragments())
    else {
        return Ok(None);
    };
    // One frame: all its fragments in order. Several frames with one fragment each: the
    // first. Otherwise the frame boundaries need the offset table: dicom-rs's job.
    let frame: Vec<u8> = if s.frames <= 1 {
        fragments.concat()
    } else if fragments.len() == s.frames as usize {
        fragments[0].clone()
    } else {
        return Ok(None);
    };
    let Some(jpeg) = crate::jpeg::decode_jpeg_samples(&frame, what, max_pixels)? else {
        return Ok(None);
    };
    if jpeg.channels != 1 {
        return Ok(None);
    }
    if (jpeg.width, jpeg.height) != (s.columns, s.rows) {
        return Err(ImagingError::Decode {
            what: what.to_string(),
            reason: format!(
                "the JPEG frame is {}x{} but the header says {}x{} (columns x rows)",
                jpeg.width, jpeg.height, s.columns, s.rows
            ),
        });
    }
    Ok(Some(jpeg.samples.into_iter().map(f32::from).collect()))
}

/// Reads the first VOI LUT Sequence item; an error says why it cannot be used.
fn voi_table(obj: &DicomFile, signed_pixels: bool) -> Result<VoiTable, String> {
    let item = obj
        .get(tags::VOILUT_SEQUENCE)
        .and_then(|e| e.items())
        .and_then(|items| items.first())
        .ok_or("the VOI LUT Sequence has no item")?;
    let desc: Vec<i64> = item
        .get(tags::LUT_DESCRIPTOR)
        .ok_or("no LUT Descriptor")?
        .to_multi_int::<i64>()
        .map_err(|e| format!("unreadable LUT Descriptor: {e}"))?;
    let [count, first, bits] = desc[..] else {
        return Err(format!("LUT Descriptor has {} values, not 3", desc.len()));
    };
    // 0 entries means 65536 (PS3.3 C.11.1.1); a US first value means a negative one for
    // signed pixels when its top bit is set.
    let count = if count == 0 { 65536 } else { count as usize };
    let first = if signed_pixels && first >= 32768 {
        first - 65536
    } else {
        first
    };
    if !(8..=16).contains(&bits) {
        return Err(format!("{bits} bits per entry (8 to 16 are valid)"));
    }
    let data = item.get(tags::LUT_DATA).ok_or("no LUT Data")?;
    let entries: Vec<u16> = match data.value().primitive() {
        // OW read as bytes (implicit VR, or OB/OW kept raw): little-endian words.
        Some(dicom_core::PrimitiveValue::U8(bytes)) => bytes
            .chunks_exact(2)
            .map(|w| u16::from_le_bytes([w[0], w[1]]))
            .collect(),
        Some(_) => data
            .to_multi_int::<u16>()
            .map_err(|e| format!("unreadable LUT Data: {e}"))?,
        None => return Err("LUT Data is not a primitive value".into()),
    };
    if entries.len() < count {
        return Err(format!(
            "LUT Data holds {} entries, the descriptor says {count}",
            entries.len()
        ));
    }
    Ok(VoiTable {
        first,
        entries: entries[..count].to_vec(),
        bits: bits as u32,
    })
}

/// The VOI LUT functions of DICOM PS3.3 C.11.2.1.2, mapping to `0..=y_max`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum VoiFn {
    Linear,
    LinearExact,
    Sigmoid,
}

impl VoiFn {
    fn parse(name: Option<&str>, voi: Voi) -> Self {
        // A caller-given window is a plain linear window whatever the file says.
        if matches!(voi, Voi::Window { .. }) {
            return VoiFn::Linear;
        }
        match name {
            Some("LINEAR_EXACT") => VoiFn::LinearExact,
            Some("SIGMOID") => VoiFn::Sigmoid,
            _ => VoiFn::Linear,
        }
    }

    fn apply(self, x: f64, c: f64, w: f64, y_max: f64) -> f64 {
        match self {
            VoiFn::Linear => {
                let (c, w) = (c - 0.5, w - 1.0);
                if x <= c - w / 2.0 {
                    0.0
                } else if x > c + w / 2.0 {
                    y_max
                } else {
                    ((x - c) / w.max(f64::EPSILON) + 0.5) * y_max
                }
            }
            VoiFn::LinearExact => {
                if x <= c - w / 2.0 {
                    0.0
                } else if x > c + w / 2.0 {
                    y_max
                } else {
                    ((x - c) / w + 0.5) * y_max
                }
            }
            VoiFn::Sigmoid => y_max / (1.0 + (-4.0 * (x - c) / w).exp()),
        }
    }
}

const UNDEFINED: u32 = 0xFFFF_FFFF;

/// Walks the element headers and refuses any defined length longer than the bytes left.
/// dicom-rs reserves and zero-fills the declared length before reading, so one corrupt
/// length in a 100 KB file would otherwise cost gigabytes and seconds.
pub(crate) fn check_lengths(bytes: &[u8], what: &str) -> Result<(), ImagingError> {
    let corrupt = |at: usize, reason: String| ImagingError::Decode {
        what: what.to_string(),
        reason: format!("corrupt DICOM at byte {at}: {reason}"),
    };
    let n = bytes.len();
    let rd16 = |p: usize, big: bool| {
        let b = [bytes[p], bytes[p + 1]];
        if big {
            u16::from_be_bytes(b)
        } else {
            u16::from_le_bytes(b)
        }
    };
    let rd32 = |p: usize, big: bool| {
        let b = [bytes[p], bytes[p + 1], bytes[p + 2], bytes[p + 3]];
        if big {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        }
    };
    let long_vr = |vr: &[u8]| {
        matches!(
            vr,
            b"OB"
                | b"OD"
                | b"OF"
                | b"OL"
                | b"OV"
                | b"OW"
                | b"SQ"
                | b"SV"
                | b"UC"
                | b"UN"
                | b"UR"
                | b"UT"
                | b"UV"
        )
    };
    let (mut pos, ts) = if n >= 132 && &bytes[128..132] == b"DICM" {
        (132, None)
    } else if bytes.starts_with(b"DICM") {
        (4, None)
    } else {
        (0, bare_dataset_ts(bytes).map(str::to_string))
    };
    let ts = match ts {
        Some(ts) => ts,
        None => {
            // File Meta: always explicit VR little endian, group 0x0002.
            let mut meta_ts = String::new();
            while pos + 8 <= n && rd16(pos, false) == 0x0002 {
                let vr = &bytes[pos + 4..pos + 6];
                let (len, hdr) = if long_vr(vr) {
                    if pos + 12 > n {
                        break;
                    }
                    (rd32(pos + 8, false), 12)
                } else {
                    (rd16(pos + 6, false) as u32, 8)
                };
                if len == UNDEFINED || len as usize > n - pos - hdr {
                    return Err(corrupt(
                        pos,
                        format!("File Meta element claims {len} bytes"),
                    ));
                }
                if rd16(pos + 2, false) == 0x0010 {
                    meta_ts = String::from_utf8_lossy(&bytes[pos + hdr..pos + hdr + len as usize])
                        .trim_end_matches(['\0', ' '])
                        .to_string();
                }
                pos += hdr + len as usize;
            }
            meta_ts
        }
    };
    let (explicit, big) = match ts.as_str() {
        IMPLICIT_VR_LE => (false, false),
        "1.2.840.10008.1.2.2" => (true, true),
        // Deflated: the rest is compressed; dicom-rs inflates it with its own bounds.
        "1.2.840.10008.1.2.1.99" => return Ok(()),
        _ => (true, false),
    };
    let mut in_pixels = false;
    while pos + 8 <= n {
        let (group, elem) = (rd16(pos, big), rd16(pos + 2, big));
        if group == 0xFFFE {
            let len = rd32(pos + 4, big);
            pos += 8;
            match elem {
                0xE000 if len != UNDEFINED => {
                    if len as usize > n - pos {
                        return Err(corrupt(
                            pos,
                            format!("item claims {len} bytes, {} left", n - pos),
                        ));
                    }
                    // Fragments are opaque; dataset items are walked into.
                    if in_pixels {
                        pos += len as usize;
                    }
                }
                0xE0DD => in_pixels = false,
                _ => {}
            }
            continue;
        }
        let (len, hdr, is_sq) = if explicit {
            let vr = &bytes[pos + 4..pos + 6];
            if !(vr[0].is_ascii_uppercase() && vr[1].is_ascii_uppercase()) {
                return Err(corrupt(
                    pos,
                    format!("invalid VR in element ({group:04X},{elem:04X})"),
                ));
            }
            if long_vr(vr) {
                if pos + 12 > n {
                    break;
                }
                (rd32(pos + 8, big), 12, vr == b"SQ")
            } else {
                (rd16(pos + 6, big) as u32, 8, false)
            }
        } else {
            use dicom_core::dictionary::{DataDictionary, DataDictionaryEntry, VirtualVr};
            let sq = dicom_dictionary_std::StandardDataDictionary
                .by_tag(Tag(group, elem))
                .is_some_and(|e| matches!(e.vr(), VirtualVr::Exact(dicom_core::VR::SQ)));
            (rd32(pos + 4, big), 8, sq)
        };
        pos += hdr;
        if len == UNDEFINED {
            in_pixels |= (group, elem) == (0x7FE0, 0x0010);
            continue;
        }
        if len as usize > n - pos {
            return Err(corrupt(
                pos,
                format!(
                    "element ({group:04X},{elem:04X}) claims {len} bytes, {} left (truncated?)",
                    n - pos
                ),
            ));
        }
        if !is_sq {
            pos += len as usize;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_window_saturates_and_is_monotone() {
        let f = VoiFn::Linear;
        assert_eq!(f.apply(0.0, 550.0, 1024.0, 1023.0), 0.0);
        assert_eq!(f.apply(2000.0, 550.0, 1024.0, 1023.0), 1023.0);
        let mid = f.apply(550.0, 550.0, 1024.0, 1023.0);
        assert!((mid - 511.5).abs() < 1.0, "{mid}");
        let mut last = -1.0;
        for x in 0..1200 {
            let y = f.apply(x as f64, 550.0, 1024.0, 1023.0);
            assert!(y >= last);
            last = y;
        }
    }

    #[test]
    fn bare_dataset_detection_needs_a_plausible_first_element() {
        assert!(
            bare_dataset_ts(&[0x08, 0, 0x05, 0, 10, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
                .is_some()
        );
        assert!(bare_dataset_ts(b"\x89PNG\r\n\x1a\n").is_none());
        assert!(bare_dataset_ts(&[0x08, 0, 0x05, 0, 0xff, 0xff, 0xff, 0x7f]).is_none());
    }
}
