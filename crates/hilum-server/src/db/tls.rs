//! TLS to PostgreSQL through rustls, configured like libpq: `sslmode` and `sslrootcert` in the
//! URL's query (<https://www.postgresql.org/docs/current/libpq-ssl.html>, table 34.1).
//! tokio-postgres knows only disable/prefer/require and no CA file, so both options are taken
//! out of the URL here and turned into a rustls verifier.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's `sslmode` values (`allow` is left out: it only tries TLS after plain text failed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    /// Plain text only.
    Disable,
    /// TLS when the server offers it, without verifying its certificate; plain text otherwise.
    /// The default, as in libpq, so that a URL means what it means to `psql`.
    Prefer,
    /// TLS or nothing; the certificate is verified only when a CA file is given (libpq then
    /// behaves as `verify-ca`).
    Require,
    /// TLS, with a certificate signed by the CA; any host name.
    VerifyCa,
    /// TLS, with a certificate signed by the CA and naming the host connected to.
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Option<SslMode> {
        Some(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// What tokio-postgres is told: whether to ask for TLS, and whether to give up without it.
    pub(crate) fn negotiation(self) -> tokio_postgres::config::SslMode {
        match self {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        })
    }
}

/// The TLS options of a URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TlsOptions {
    pub(crate) mode: SslMode,
    pub(crate) root_cert: Option<PathBuf>,
}

/// Takes `sslmode` and `sslrootcert` out of a `postgres://` URL: returns the URL without them
/// (for tokio-postgres) and the options. `Err` says which value is wrong.
pub(crate) fn split_url(url: &str) -> Result<(String, TlsOptions), String> {
    let mut opts = TlsOptions {
        mode: SslMode::Prefer,
        root_cert: None,
    };
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), opts));
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "sslmode" => {
                opts.mode = SslMode::parse(value).ok_or_else(|| {
                    format!("sslmode={value} is not one of disable, prefer, require, verify-ca, verify-full")
                })?;
            }
            "sslrootcert" => opts.root_cert = Some(PathBuf::from(percent_decode(value)?)),
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, opts))
}

/// `%2F` → `/`: a CA path in a URL query may be percent-encoded.
fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("`{s}` has a bad %-escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("`{s}` is not UTF-8 once decoded"))
}

/// The rustls connector for `opts`. `Err` says what is wrong with the CA file.
pub(crate) fn connector(opts: &TlsOptions) -> Result<MakeRustlsConnect, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verify_chain = matches!(opts.mode, SslMode::VerifyCa | SslMode::VerifyFull)
        || (opts.mode == SslMode::Require && opts.root_cert.is_some());
    let verifier: Arc<dyn ServerCertVerifier> = if verify_chain {
        let roots = match &opts.root_cert {
            Some(path) => ca_file(path)?,
            // No CA file: the Mozilla roots reqwest already uses (a public CA's certificate).
            None => RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        };
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| format!("cannot use the CA certificates: {e}"))?;
        if opts.mode == SslMode::VerifyFull {
            webpki
        } else {
            Arc::new(AnyName(webpki))
        }
    } else {
        Arc::new(Unverified(provider.clone()))
    };
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("rustls: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

/// The certificates of a PEM file (one CA, or a bundle).
fn ca_file(path: &Path) -> Result<RootCertStore, String> {
    let shown = path.display();
    let mut roots = RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read the CA file sslrootcert={shown}: {e}"))?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("the CA file {shown} is not PEM: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("the CA file {shown} holds an unusable certificate: {e}"))?;
    }
    if roots.is_empty() {
        return Err(format!("the CA file {shown} holds no PEM certificate"));
    }
    Ok(roots)
}

/// `prefer`, and `require` without a CA: encryption against passive listeners only, as in
/// libpq. The handshake signatures are still checked, against the certificate's own key.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to the CA; the host name is not compared. webpki checks the
/// chain before the name, so a name error means the chain was good.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssl_options_leave_the_url() {
        let (url, opts) = split_url(
            "postgres://u@db.local:5432/h?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.crt",
        )
        .expect("parse");
        assert_eq!(url, "postgres://u@db.local:5432/h?application_name=x");
        assert_eq!(opts.mode, SslMode::VerifyFull);
        assert_eq!(opts.root_cert, Some(PathBuf::from("/etc/ca.crt")));

        let (url, opts) = split_url("postgres://u@h/d").expect("parse");
        assert_eq!(
            (url.as_str(), opts.mode),
            ("postgres://u@h/d", SslMode::Prefer)
        );

        let err = split_url("postgres://u@h/d?sslmode=allow").expect_err("allow is left out");
        assert!(err.contains("verify-full"), "{err}");
    }

    #[test]
    fn a_missing_or_empty_ca_file_is_named() {
        let opts = |p: &Path| TlsOptions {
            mode: SslMode::VerifyFull,
            root_cert: Some(p.to_path_buf()),
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("none.crt");
        let err = connector(&opts(&missing)).err().expect("missing file");
        assert!(err.contains("none.crt"), "{err}");
        let empty = dir.path().join("empty.crt");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let err = connector(&opts(&empty)).err().expect("no certificate");
        assert!(err.contains("no PEM certificate"), "{err}");
    }
}
