#!/usr/bin/env python3
"""Reads Hilum's DICOM results with highdicom, an independent reader, and prints what it found
as JSON on stdout, so that tests can compare it with what Hilum meant to write.

    pacs_check.py sr FILE.dcm     # the TID 1500 SR: observer, measurement groups, evaluations
    pacs_check.py seg FILE.dcm    # the SEG: each segment's codes and mask (sha256, pixel count)
    pacs_check.py sc FILE.dcm     # the secondary capture: pixels (sha256), derivation

Everything printed comes from highdicom's own parsing (hd.sr.srread + MeasurementReport,
hd.seg.segread + get_segment_mask / get_pixels_by_source_instance), and pydicom for the SC.
A mask's sha256 is over its bool array as one byte per pixel (0/1), row-major — the same bytes
Hilum's tests hash. Install: bash scripts/setup_pacs_tools.sh (venv scripts/.venv-pacs,
pinned in scripts/requirements-pacs.txt).
"""
import hashlib
import json
import sys

import highdicom as hd
import numpy as np
import pydicom
from highdicom.sr.utils import find_content_items
from pydicom.sr.codedict import codes


def code(c):
    if c is None:
        return None
    return {"value": c.value, "scheme": c.scheme_designator, "meaning": c.meaning}


def text_items(item, name):
    if "ContentSequence" not in item:
        return []
    return [
        i.value
        for i in find_content_items(item, name=name, value_type=hd.sr.ValueTypeValues.TEXT)
    ]


def algorithm(item):
    names = text_items(item, codes.DCM.AlgorithmName)
    versions = text_items(item, codes.DCM.AlgorithmVersion)
    if not names:
        return None
    return {"name": names[0], "version": versions[0] if versions else None}


def check_sr(path):
    sr = hd.sr.srread(path)
    report = sr.content
    if not isinstance(report, hd.sr.MeasurementReport):
        raise SystemExit(f"{path}: highdicom does not read it as a TID 1500 MeasurementReport")
    root = report[0]
    observers = []
    for ctx in report.get_observer_contexts():
        attrs = ctx.observer_identifying_attributes
        observers.append(
            {
                "type": code(ctx.observer_type),
                "uid": str(attrs.uid),
                "name": attrs.name,
                "manufacturer": attrs.manufacturer_name,
                "model_name": attrs.model_name,
                "serial_number": attrs.serial_number,
            }
        )
    groups = []
    for group in report.get_image_measurement_groups():
        g = group[0]
        measurements = []
        for m in group.get_measurements():
            tracking = text_items(m[0], codes.DCM.TrackingIdentifier)
            measurements.append(
                {
                    "name": code(m.name),
                    "value": m.value,
                    # The exact double as text: JSON readers may round a number's last digit.
                    "value_repr": repr(float(m.value)),
                    "unit": code(m.unit),
                    "tracking_identifier": tracking[0] if tracking else None,
                    "finding_sites": [code(s.value) for s in m.finding_sites],
                    "algorithm": algorithm(m[0]),
                }
            )
        sources = [
            str(i.referenced_sop_instance_uid)
            for i in find_content_items(g, value_type=hd.sr.ValueTypeValues.IMAGE)
        ]
        groups.append(
            {
                "tracking_identifier": group.tracking_identifier,
                "tracking_uid": str(group.tracking_uid) if group.tracking_uid else None,
                "finding": code(group.finding_type),
                "algorithm": algorithm(g),
                "source_images": sources,
                "measurements": measurements,
            }
        )
    evaluations = []
    for container in find_content_items(
        root,
        name=hd.sr.CodedConcept("C0034375", "UMLS", "Qualitative Evaluations"),
        value_type=hd.sr.ValueTypeValues.CONTAINER,
    ):
        for item in container.ContentSequence:
            evaluations.append({"name": code(item.name), "text": item.value})
    evidence = []
    for study in sr.CurrentRequestedProcedureEvidenceSequence:
        for series in study.ReferencedSeriesSequence:
            for inst in series.ReferencedSOPSequence:
                evidence.append(
                    {
                        "study": study.StudyInstanceUID,
                        "series": series.SeriesInstanceUID,
                        "sop_class": inst.ReferencedSOPClassUID,
                        "sop_instance": inst.ReferencedSOPInstanceUID,
                    }
                )
    return {
        "sop_class": sr.SOPClassUID,
        "sop_instance": sr.SOPInstanceUID,
        "series": sr.SeriesInstanceUID,
        "study": sr.StudyInstanceUID,
        "patient_id": str(sr.get("PatientID", "")),
        "patient_name": str(sr.get("PatientName", "")),
        "title": code(report.title if hasattr(report, "title") else root.name),
        "observers": observers,
        "procedure_reported": [
            code(i.value)
            for i in find_content_items(root, name=codes.DCM.ProcedureReported)
        ],
        "groups": groups,
        "qualitative_evaluations": evaluations,
        "evidence": evidence,
    }


def mask_digest(mask):
    flat = np.ascontiguousarray(mask.astype(np.uint8).reshape(-1))
    return {"sha256": hashlib.sha256(flat.tobytes()).hexdigest(), "pixels": int(flat.sum())}


def check_seg(path):
    seg = hd.seg.segread(path)
    sources = [
        {"study": s[0], "series": s[1], "sop_instance": s[2]}
        for s in seg.get_source_image_uids()
    ]
    segments = []
    for number in seg.segment_numbers:
        desc = seg.get_segment_description(number)
        # One source image, one frame per segment: the mask in the source's geometry.
        pixels = seg.get_pixels_by_source_instance(
            source_sop_instance_uids=[sources[0]["sop_instance"]],
            segment_numbers=[number],
            combine_segments=False,
        )
        mask = np.asarray(pixels)[0, :, :, 0].astype(bool)
        algo = desc.algorithm_identification
        segments.append(
            {
                "number": number,
                "label": desc.segment_label,
                "category": code(desc.segmented_property_category),
                "type": code(desc.segmented_property_type),
                "algorithm_type": desc.algorithm_type.value,
                "algorithm_name": algo.name if algo is not None else None,
                "algorithm_version": algo.version if algo is not None else None,
                "shape": list(mask.shape),
                **mask_digest(mask),
            }
        )
    shared = seg.SharedFunctionalGroupsSequence[0]
    spacing = None
    if "PixelMeasuresSequence" in shared:
        spacing = [float(v) for v in shared.PixelMeasuresSequence[0].PixelSpacing]
    return {
        "sop_class": seg.SOPClassUID,
        "sop_instance": seg.SOPInstanceUID,
        "series": seg.SeriesInstanceUID,
        "study": seg.StudyInstanceUID,
        "segmentation_type": seg.segmentation_type.value,
        "source_images": sources,
        "pixel_spacing": spacing,
        "segments": segments,
    }


def check_sc(path):
    ds = pydicom.dcmread(path)
    arr = ds.pixel_array
    return {
        "sop_class": ds.SOPClassUID,
        "sop_instance": ds.SOPInstanceUID,
        "series": ds.SeriesInstanceUID,
        "study": ds.StudyInstanceUID,
        "image_type": list(ds.ImageType),
        "burned_in_annotation": ds.BurnedInAnnotation,
        "derivation_description": ds.DerivationDescription,
        "source_images": [i.ReferencedSOPInstanceUID for i in ds.SourceImageSequence],
        "shape": list(arr.shape),
        "rgb_sha256": hashlib.sha256(np.ascontiguousarray(arr, dtype=np.uint8).tobytes()).hexdigest(),
    }


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("sr", "seg", "sc"):
        raise SystemExit(__doc__)
    kind, path = sys.argv[1], sys.argv[2]
    out = {"sr": check_sr, "seg": check_seg, "sc": check_sc}[kind](path)
    out["highdicom"] = hd.__version__
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    print()


if __name__ == "__main__":
    main()
