// Prefill / decode disaggregation's pieces (server/kv_transfer.h): kv_transfer_params, Host headers, the export
// answer's encoding, and fetch_kv_rows against a small export server of known rows (read in chunks, rows evicted
// between reads, errors, unreachable servers).
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <random>
#include <thread>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "core/error.h"
#include "json_mutation.h"
#include "server/api_error.h"
#include "server/kv_transfer.h"

namespace mlaserve::server {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using json = nlohmann::json;

// The param of the ApiError `fn` throws (empty when it throws none).
template <typename Fn>
std::string api_error_param(Fn&& fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    return e.param.empty() ? "(none)" : e.param;
  }
  return {};
}

TEST(KvTransferParams, ParsedAsVllmSendsThem) {
  EXPECT_FALSE(parse_kv_transfer_params(json(nullptr)).has_value());
  const auto pre = parse_kv_transfer_params(json{{"do_remote_decode", true}, {"do_remote_prefill", false},
                                                 {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                                                 {"remote_host", nullptr}, {"remote_port", nullptr}});
  ASSERT_TRUE(pre);
  EXPECT_TRUE(pre->remote_decode);
  EXPECT_FALSE(pre->remote_prefill);
  const json answer = kv_transfer_answer("10.0.0.7", 8100, "cmpl-1");
  const auto dec = parse_kv_transfer_params(answer);  // the prefill's answer, sent on to the decode server as it is
  ASSERT_TRUE(dec);
  EXPECT_TRUE(dec->remote_prefill);
  EXPECT_FALSE(dec->remote_decode);
  EXPECT_EQ(dec->remote_host, "10.0.0.7");
  EXPECT_EQ(dec->remote_port, 8100);
  for (const json& bad : {json("x"), json::array(), json{{"do_remote_decode", 1}},
                          json{{"do_remote_prefill", true}, {"remote_port", 80}},
                          json{{"do_remote_prefill", true}, {"remote_host", ""}, {"remote_port", 80}},
                          json{{"do_remote_prefill", true}, {"remote_host", "h"}, {"remote_port", 70000}},
                          json{{"do_remote_prefill", true}, {"remote_host", "h"}, {"remote_port", "80"}},
                          json{{"do_remote_prefill", true}, {"do_remote_decode", true}, {"remote_host", "h"},
                               {"remote_port", 80}}})
    EXPECT_EQ(api_error_param([&] { parse_kv_transfer_params(bad); }), "kv_transfer_params") << bad.dump();
}

TEST(KvTransferParams, HostHeaders) {
  using HP = std::pair<std::string, int32_t>;
  EXPECT_EQ(split_host_port("example.com"), HP("example.com", 0));
  EXPECT_EQ(split_host_port("example.com:8080"), HP("example.com", 8080));
  EXPECT_EQ(split_host_port("10.1.2.3:30000"), HP("10.1.2.3", 30000));
  EXPECT_EQ(split_host_port("[::1]:9000"), HP("::1", 9000));
  EXPECT_EQ(split_host_port("[fe80::1]"), HP("fe80::1", 0));
  EXPECT_EQ(split_host_port("fe80::1"), HP("fe80::1", 0));  // a bare v6 address has no port
  EXPECT_EQ(split_host_port("h:99999"), HP("h", 0));
  EXPECT_EQ(split_host_port("h:x1"), HP("h", 0));
  EXPECT_EQ(split_host_port(""), HP("", 0));
}

TEST(KvTransferParams, SglangBootstrapFields) {
  EXPECT_TRUE(parse_bootstrap(json{{"bootstrap_host", "h"}}, 1, 8998).empty());  // no room: none
  auto one = parse_bootstrap(json{{"bootstrap_host", "p1"}, {"bootstrap_room", 5}}, 2, 8998);
  ASSERT_EQ(one.size(), 2u);  // one value for every prompt; the port's default
  EXPECT_EQ(one[1].host, "p1");
  EXPECT_EQ(one[1].port, 8998);
  EXPECT_EQ(one[1].room, 5u);
  const uint64_t big = (uint64_t{1} << 63) - 1;
  auto lists = parse_bootstrap(json{{"bootstrap_host", {"a", "b"}}, {"bootstrap_port", {9000, nullptr}},
                                    {"bootstrap_room", {big, 0}}},
                               2, 8998);
  EXPECT_EQ(lists[0].host, "a");
  EXPECT_EQ(lists[0].port, 9000);
  EXPECT_EQ(lists[0].room, big);
  EXPECT_EQ(lists[1].host, "b");
  EXPECT_EQ(lists[1].port, 8998);
  EXPECT_EQ(lists[1].room, 0u);
  EXPECT_EQ(api_error_param([] { parse_bootstrap(json{{"bootstrap_host", "h"}, {"bootstrap_room", -1}}, 1, 1); }),
            "bootstrap_room");
  EXPECT_EQ(api_error_param([] { parse_bootstrap(json{{"bootstrap_host", "h"}, {"bootstrap_room", "1"}}, 1, 1); }),
            "bootstrap_room");
  EXPECT_EQ(api_error_param([] { parse_bootstrap(json{{"bootstrap_room", 1}}, 1, 1); }), "bootstrap_host");
  EXPECT_EQ(api_error_param([] {
              parse_bootstrap(json{{"bootstrap_host", "h"}, {"bootstrap_room", {1, 2, 3}}}, 2, 1);
            }),
            "bootstrap_room");
  EXPECT_EQ(api_error_param([] {
              parse_bootstrap(json{{"bootstrap_host", "h"}, {"bootstrap_port", 0}, {"bootstrap_room", 1}}, 1, 1);
            }),
            "bootstrap_port");
}

// The prefill side's rooms: a wait for an ended room answers at once, a wait ends with its room's end (true) or its
// timeout (false); only the last kKept ended rooms are remembered.
TEST(KvTransferParams, BootstrapRoomsWaitForTheirEnd) {
  BootstrapRooms rooms;
  auto waited = [&](uint64_t room, std::chrono::milliseconds t) {
    auto p = std::make_shared<std::promise<bool>>();
    rooms.when_ended(room, t, [p](bool ended) { p->set_value(ended); });
    return p->get_future();
  };
  rooms.end(1);
  auto at_once = waited(1, std::chrono::hours(1));
  ASSERT_EQ(at_once.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  EXPECT_TRUE(at_once.get());
  auto later = waited(2, std::chrono::hours(1)), other = waited(3, std::chrono::hours(1));
  EXPECT_EQ(later.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  rooms.end(2);
  ASSERT_EQ(later.wait_for(std::chrono::seconds(0)), std::future_status::ready);  // (ended on this thread)
  EXPECT_TRUE(later.get());
  EXPECT_EQ(other.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  auto late = waited(4, std::chrono::milliseconds(1));
  ASSERT_EQ(late.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_FALSE(late.get());
  for (uint64_t r = 100; r < 100 + BootstrapRooms::kKept; ++r) rooms.end(r);  // room 1 forgotten
  auto forgotten = waited(1, std::chrono::milliseconds(1));
  ASSERT_EQ(forgotten.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_FALSE(forgotten.get());
  rooms.end(3);
  EXPECT_TRUE(other.get());
}

TEST(KvTransferParams, RoomsNamedByABody) {
  EXPECT_EQ(bootstrap_rooms_named(json{{"bootstrap_room", 5}}), std::vector<uint64_t>{5});
  EXPECT_EQ(bootstrap_rooms_named(json{{"bootstrap_room", {1, -2, "x", 18446744073709551615ull}}}),
            (std::vector<uint64_t>{1, 18446744073709551615ull}));
  for (const json& b : {json{{"bootstrap_room", -1}}, json{{"bootstrap_room", nullptr}}, json{{"text", "hi"}},
                        json::array({1})})
    EXPECT_TRUE(bootstrap_rooms_named(b).empty()) << b.dump();
}

// Rows of tokens [begin, end) with known bytes (token t's layer l, byte b: l * 31 + t * 7 + b), in token order, after
// `room` bytes of header room (an export's).
KvRows rows_of(int32_t begin, int32_t end, int32_t cached, int64_t layers, int64_t row_bytes, size_t room = 0) {
  KvRows r;
  r.begin = begin;
  r.end = end;
  r.cached = cached;
  r.layers = layers;
  r.row_bytes = row_bytes;
  r.dtype = "bf16";
  r.bytes.assign(room, 'x');
  r.offset = room;
  for (int32_t t = begin; t < end; ++t)
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t b = 0; b < row_bytes; ++b) r.bytes.push_back(static_cast<char>(l * 31 + t * 7 + b));
  return r;
}

std::string rows_text(const KvRows& r) { return std::string(r.rows(), r.rows_size()); }

// A fetched prefix's parts, checked consecutive from token 0, as one run of rows.
std::string joined(const KvPrefix& parts) {
  std::string out;
  int32_t at = 0;
  for (const KvRows& p : parts) {
    EXPECT_EQ(p.begin, at);
    at = p.end;
    out += rows_text(p);
  }
  return out;
}

TEST(KvTransferRows, EncodedAndDecoded) {
  // With the export's header room the line goes there (the rows not copied); a room too small, or none: copied.
  for (size_t room : {kKvExportHeaderRoom, size_t{0}, size_t{20}}) {
    SCOPED_TRACE(room);
    const KvRows r = rows_of(3, 10, 16, 2, 5, room);
    const std::string enc = encode_kv_rows(r);
    EXPECT_EQ(enc.size() - enc.find('\n') - 1, r.rows_size());
    if (room == kKvExportHeaderRoom) {
      EXPECT_EQ(enc.size(), r.bytes.size());
    }
    const KvRows back = decode_kv_rows(enc);
    EXPECT_EQ(back.begin, 3);
    EXPECT_EQ(back.end, 10);
    EXPECT_EQ(back.cached, 16);
    EXPECT_TRUE(back.same_layout(r));
    EXPECT_EQ(rows_text(back), rows_text(r));
    EXPECT_THROW(decode_kv_rows(enc.substr(0, enc.size() - 1)), Error);  // a byte short
    EXPECT_THROW(decode_kv_rows(enc + "x"), Error);
  }
  EXPECT_THROW(decode_kv_rows("no header"), Error);
  EXPECT_THROW(decode_kv_rows("[1]\n"), Error);
  EXPECT_THROW(decode_kv_rows(R"({"begin": 0})" "\n"), Error);
  EXPECT_THROW(decode_kv_rows(R"({"begin": 5, "end": 2, "cached": 9, "layers": 1, "row_bytes": 1, "dtype": "x",)"
                              R"( "layout": "token,layer,row"})" "\n"),
               Error);
  // Rows in another order (an older server's layer-major answer) are refused, not misread.
  try {
    decode_kv_rows(R"({"begin": 0, "end": 1, "cached": 1, "layers": 1, "row_bytes": 1, "dtype": "x",)"
                   R"( "layout": "layer,token,row"})" "\nz");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer,token,row"), std::string::npos) << e.what();
  }
}

// Answers of another server (a prefill server of another build, or a broken one) with the header line edited at random
// and rows cut or added: each decodes to a consistent answer from integer fields, or is refused with an Error, never
// another exception (a float such as 1e10 was converted to int32 before: undefined behaviour).
TEST(KvTransferRows, EditedAnswersDecodeConsistentlyOrAreRefused) {
  const std::string enc = encode_kv_rows(rows_of(3, 10, 16, 2, 5, 0));
  const size_t nl = enc.find('\n');
  const json header = json::parse(enc.substr(0, nl));
  const std::string rows = enc.substr(nl + 1);
  const std::vector<json> values =
      test::edge_values({"token,layer,row", "layer,token,row", 1e10, -1e10, 4.5, 3.0, 10.0, 16.0, 2.0, 5.0});
  std::mt19937_64 rng(20261207);
  int decoded = 0, refused = 0;
  for (int it = 0; it < 3000; ++it) {
    json h = header;
    const int edits = static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) test::mutate_json(h, rng, values);
    std::string body = rows;
    if (rng() % 4 == 0) body.resize(rng() % (rows.size() + 8), 'r');
    try {
      const KvRows r = decode_kv_rows(h.dump() + "\n" + body);
      ++decoded;
      EXPECT_TRUE(r.begin >= 0 && r.begin <= r.end && r.end <= r.cached) << h.dump();
      EXPECT_EQ(r.rows_size(), static_cast<size_t>(r.layers * r.row_bytes * (r.end - r.begin))) << h.dump();
      for (const char* k : {"begin", "end", "cached", "layers", "row_bytes"})
        EXPECT_TRUE(h[k].is_number_integer()) << k << " read from " << h.dump();
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a clear error: " << e.what() << "\n" << h.dump();
    }
  }
  EXPECT_GT(decoded, 100);
  EXPECT_GT(refused, 1000);
}

// An export server on the loopback: answers POST /kv_transfer/export from the rows of `cached` tokens (layers x
// row_bytes), as the engine does (tokens [begin, min(cached, begin + max_tokens))); after `evict_after` answers it
// holds only `cached_after` tokens; `status` != 200 answers that with a JSON error.
class ExportServer {
 public:
  ExportServer(int32_t cached, int status = 200, int evict_after = 1 << 30, int32_t cached_after = 0)
      : acceptor_(ioc_, tcp::endpoint(net::ip::make_address("127.0.0.1"), 0)), cached_(cached), status_(status),
        evict_after_(evict_after), cached_after_(cached_after) {
    thread_ = std::thread([this] { serve(); });
  }
  ~ExportServer() {
    stop_ = true;
    beast::error_code ec;
    tcp::socket poke(ioc_);
    poke.connect(acceptor_.local_endpoint(), ec);  // (wakes the accept)
    thread_.join();
  }
  int port() const { return acceptor_.local_endpoint().port(); }
  int reads() const { return reads_; }
  static constexpr int64_t kLayers = 3, kRowBytes = 4;

 private:
  void serve() {
    while (!stop_) {
      beast::error_code ec;
      tcp::socket s(ioc_);
      acceptor_.accept(s, ec);
      if (ec || stop_) return;
      beast::flat_buffer buf;
      http::request<http::string_body> req;
      http::read(s, buf, req, ec);
      if (ec) continue;
      http::response<http::string_body> res{http::status::ok, 11};
      if (status_ != 200) {
        res.result(static_cast<unsigned>(status_));
        res.body() = R"({"error": {"message": "no"}})";
      } else {
        const json q = json::parse(req.body());
        const int32_t cached = reads_ >= evict_after_ ? cached_after_ : cached_;
        const int32_t begin = std::min(q.at("begin").get<int32_t>(), cached);
        const int64_t most = q.at("max_tokens").get<int32_t>();
        const int32_t end = static_cast<int32_t>(std::min<int64_t>(cached, begin + most));
        res.body() = encode_kv_rows(rows_of(begin, end, cached, kLayers, kRowBytes, kKvExportHeaderRoom));
      }
      ++reads_;
      res.prepare_payload();
      http::write(s, res, ec);
    }
  }
  net::io_context ioc_;
  tcp::acceptor acceptor_;
  int32_t cached_;
  int status_;
  int evict_after_;
  int32_t cached_after_;
  std::atomic<int> reads_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

constexpr auto kTimeout = std::chrono::seconds(10);

TEST(KvTransferRows, FetchedInChunksAsOneRead) {
  ExportServer srv(40);
  const std::vector<int32_t> tokens(45, 7);
  std::string why;
  const auto whole = fetch_kv_rows("127.0.0.1", srv.port(), "", tokens, "", kTimeout, why);
  ASSERT_TRUE(whole) << why;
  EXPECT_EQ(srv.reads(), 1);
  const KvRows want = rows_of(0, 40, 40, ExportServer::kLayers, ExportServer::kRowBytes);
  ASSERT_EQ(whole->size(), 1u);
  EXPECT_EQ(whole->back().end, 40);
  EXPECT_EQ(joined(*whole), rows_text(want));
  const auto chunked = fetch_kv_rows("127.0.0.1", srv.port(), "", tokens, "", kTimeout, why, std::nullopt, 7);
  ASSERT_TRUE(chunked) << why;
  EXPECT_EQ(srv.reads(), 1 + 6);  // 7, 14, ..., 40
  ASSERT_EQ(chunked->size(), 6u);
  EXPECT_EQ(chunked->back().end, 40);
  EXPECT_EQ(joined(*chunked), rows_text(want));
}

TEST(KvTransferRows, RowsEvictedBetweenReadsKeepTheFirstOnes) {
  ExportServer srv(40, 200, /*evict_after=*/2, /*cached_after=*/10);
  std::string why;
  const auto got =
      fetch_kv_rows("127.0.0.1", srv.port(), "", std::vector<int32_t>(45, 1), "", kTimeout, why, std::nullopt, 8);
  ASSERT_TRUE(got) << why;
  EXPECT_EQ(got->back().end, 16);  // two reads of 8; the third finds only 10 cached
  EXPECT_EQ(joined(*got), rows_text(rows_of(0, 16, 16, ExportServer::kLayers, ExportServer::kRowBytes)));
}

TEST(KvTransferRows, NothingFromServersWithoutRowsOrFailing) {
  std::string why;
  {
    ExportServer none(0);
    EXPECT_FALSE(fetch_kv_rows("127.0.0.1", none.port(), "", {1, 2, 3}, "", kTimeout, why));
    EXPECT_NE(why.find("holds none"), std::string::npos) << why;
  }
  {
    ExportServer failing(40, 503);
    EXPECT_FALSE(fetch_kv_rows("127.0.0.1", failing.port(), "", {1, 2, 3}, "", kTimeout, why));
    EXPECT_NE(why.find("503"), std::string::npos) << why;
  }
  int closed = 0;
  {
    ExportServer gone(0);
    closed = gone.port();
  }
  EXPECT_FALSE(fetch_kv_rows("127.0.0.1", closed, "", {1, 2, 3}, "", kTimeout, why));
  EXPECT_NE(why.find("connecting"), std::string::npos) << why;
  EXPECT_FALSE(fetch_kv_rows("no-such-host.invalid", 80, "", {1}, "", kTimeout, why));
  EXPECT_FALSE(why.empty());
}

}  // namespace
}  // namespace mlaserve::server
