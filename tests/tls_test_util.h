// TLS test material made at run time with OpenSSL: a CA and a certificate it signs for 127.0.0.1 / localhost (the
// server's, also usable as a client certificate), written as PEM files.
#pragma once

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace mlaserve::test {

struct TlsFiles {
  std::string ca_cert;   // the CA (what clients trust)
  std::string cert;      // the leaf certificate, signed by the CA
  std::string key;       // its private key (unencrypted)
  std::string key_encrypted;  // the same key encrypted with kTlsKeyPassword
};

inline constexpr const char* kTlsKeyPassword = "hunter2";

namespace tls_detail {

inline void check(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string("test TLS material: ") + what);
}

inline void add_ext(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  check(ext != nullptr, value);
  X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
}

// A certificate for `cn` with `key`, valid for a day, issued by (issuer, issuer_key) or self-signed when null.
inline X509* make_cert(EVP_PKEY* key, const char* cn, long serial, X509* issuer, EVP_PKEY* issuer_key, bool ca) {
  X509* x = X509_new();
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), serial);
  X509_gmtime_adj(X509_getm_notBefore(x), -60);
  X509_gmtime_adj(X509_getm_notAfter(x), 24 * 3600);
  X509_set_pubkey(x, key);
  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(cn), -1, -1, 0);
  X509_set_issuer_name(x, issuer ? X509_get_subject_name(issuer) : name);
  X509* iss = issuer ? issuer : x;
  add_ext(x, iss, NID_subject_key_identifier, "hash");
  if (ca) {
    add_ext(x, iss, NID_basic_constraints, "critical,CA:TRUE");
    add_ext(x, iss, NID_key_usage, "critical,keyCertSign,cRLSign");
  } else {
    add_ext(x, iss, NID_authority_key_identifier, "keyid:always");
    add_ext(x, iss, NID_basic_constraints, "critical,CA:FALSE");
    add_ext(x, iss, NID_key_usage, "critical,digitalSignature,keyEncipherment");
    add_ext(x, iss, NID_ext_key_usage, "serverAuth,clientAuth");
    add_ext(x, iss, NID_subject_alt_name, "IP:127.0.0.1,DNS:localhost");
  }
  check(X509_sign(x, issuer_key ? issuer_key : key, EVP_sha256()) > 0, "signing");
  return x;
}

inline void write_pem(const std::string& path, X509* cert, EVP_PKEY* key, const char* password) {
  FILE* f = std::fopen(path.c_str(), "w");
  check(f != nullptr, path.c_str());
  bool ok = true;
  if (cert) ok = PEM_write_X509(f, cert) == 1;
  if (key)
    ok = ok && PEM_write_PrivateKey(f, key, password ? EVP_aes_256_cbc() : nullptr,
                                    reinterpret_cast<const unsigned char*>(password),
                                    password ? static_cast<int>(std::char_traits<char>::length(password)) : 0,
                                    nullptr, nullptr) == 1;
  std::fclose(f);
  check(ok, path.c_str());
}

}  // namespace tls_detail

// Writes ca.pem, cert.pem, key.pem and key_encrypted.pem into dir (made if absent).
inline TlsFiles write_tls_files(const std::filesystem::path& dir) {
  using namespace tls_detail;
  std::filesystem::create_directories(dir);
  EVP_PKEY* ca_key = EVP_EC_gen("P-256");
  EVP_PKEY* key = EVP_EC_gen("P-256");
  check(ca_key && key, "key generation");
  X509* ca = make_cert(ca_key, "mlaserve test CA", 1, nullptr, nullptr, true);
  X509* leaf = make_cert(key, "localhost", 2, ca, ca_key, false);
  TlsFiles t{(dir / "ca.pem").string(), (dir / "cert.pem").string(), (dir / "key.pem").string(),
             (dir / "key_encrypted.pem").string()};
  write_pem(t.ca_cert, ca, nullptr, nullptr);
  write_pem(t.cert, leaf, nullptr, nullptr);
  write_pem(t.key, nullptr, key, nullptr);
  write_pem(t.key_encrypted, nullptr, key, kTlsKeyPassword);
  X509_free(leaf);
  X509_free(ca);
  EVP_PKEY_free(key);
  EVP_PKEY_free(ca_key);
  return t;
}

}  // namespace mlaserve::test
